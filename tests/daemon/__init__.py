"""Tests of kvoffload.daemon."""
