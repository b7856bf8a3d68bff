"""Tests of kvoffload.daemon.control."""
