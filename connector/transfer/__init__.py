"""The copy engine: KV tensors to pool slots and back (CUDA streams, CPU threads)."""
