"""The local disk tier."""
