"""Runnable examples: `python -m examples.train`."""
