"""agentrl: train tool-using LLM agents with multi-turn reinforcement learning."""

__version__ = "0.1.0"
