"""kvoffload.events."""
