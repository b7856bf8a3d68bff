"""kvoffload: a node-local KV-cache offload daemon for LLM serving engines."""

__version__ = "0.1.0"
