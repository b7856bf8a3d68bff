"""Tests of kvoffload.events."""
