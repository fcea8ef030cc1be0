"""Gyre: elastic online RL for extra-long-horizon LLM agents.

Nothing happens at import time: no device choice, no logging setup, no seeding.
"""

__version__ = "0.1.0"
