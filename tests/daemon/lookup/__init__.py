"""Tests of kvoffload.daemon.lookup."""
