"""Tests of kvoffload.daemon.store."""
