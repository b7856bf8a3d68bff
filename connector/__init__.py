"""kvoffload.connector."""
