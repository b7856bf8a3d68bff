"""Tests of kvoffload.daemon.ops."""
