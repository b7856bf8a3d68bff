"""Tests of kvoffload.daemon.tiers."""
