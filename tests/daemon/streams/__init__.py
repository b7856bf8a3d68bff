"""Tests of kvoffload.daemon.streams."""
