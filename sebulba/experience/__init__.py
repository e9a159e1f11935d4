"""Experience tools for agents: prioritized or uniform replay, segments of trajectories,
trajectories cut into n-step transitions for a replay, and a warm-up counted in env
steps.

The framework never calls these; agents use them inside `update_experience` and `loss`.
"""
