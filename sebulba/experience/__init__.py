"""Experience tools for agents: prioritized or uniform replay, and segments of trajectories.

The framework never calls these; agents use them inside `update_experience` and `loss`.
"""
