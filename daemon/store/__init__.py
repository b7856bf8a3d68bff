"""What is held: the pool of slots, the index over it, its shared-memory mirror, reclamation, eviction."""
