"""Tests of kvoffload.bench."""
