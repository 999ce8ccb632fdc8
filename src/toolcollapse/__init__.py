"""toolcollapse: reproduce, diagnose and prevent RL collapse in multi-step tool-using LLM agents."""

__version__ = "0.1.0"
