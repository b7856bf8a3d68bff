"""kvoffload.bench."""
