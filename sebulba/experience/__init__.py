"""Experience tools for agents: prioritized or uniform replay, segments of trajectories,
and trajectories cut into n-step transitions for a replay.

The framework never calls these; agents use them inside `update_experience` and `loss`.
"""
