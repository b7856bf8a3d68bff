"""KV-event streams: what the daemon publishes, its per-engine views, and what it consumes from engines."""
