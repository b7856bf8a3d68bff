"""Tests of kvoffload.connector."""
