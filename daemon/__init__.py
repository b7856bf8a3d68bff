"""kvoffload.daemon."""
