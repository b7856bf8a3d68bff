"""Tests of kvoffload.daemon.state."""
