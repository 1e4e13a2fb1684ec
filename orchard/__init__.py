"""orchard: training LLM agents with SFT and RL inside real sandboxes."""

__version__ = "0.1.0"
