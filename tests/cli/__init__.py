"""Tests of the kvoffload command line."""
