"""Answering lookups: the pure hit plan, the handler with futures, the tail cost model."""
