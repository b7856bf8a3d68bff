"""kvoffload.daemon.policies."""
