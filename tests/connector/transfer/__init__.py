"""Tests of kvoffload.connector.transfer."""
