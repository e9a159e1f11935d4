"""Pieces shared by agents: networks, returns, trajectory masks."""
