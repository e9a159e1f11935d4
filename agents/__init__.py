"""Agents for the Sebulba loop."""
