"""When does a partial tail pay for its bytes? A small cost model the plugin can reuse.

Time model (shared/spec/workloads.md): prefilling a token costs ``1 / prefill_tokens_per_s``,
moving a byte host-to-device ``1 / copy_bytes_per_s``; the simulated TTFT of a request is
``recomputed_tokens / prefill + loaded_bytes / copy``.

A tail hit at boundary ``b`` competes with the complete-chunk hit ``C`` below it, not with
nothing: the tail adds ``b - C`` tokens, and its load swaps the recurrent states at ``C`` for
those at ``b`` and adds the attention block that ``b`` lies in. So the tail repays its load when

    (b - C) / prefill_rate  >  (bytes(keys with tail) - bytes(keys without)) / copy_rate

which is workloads.md's ``tail_tokens / prefill > tail_bytes / copy`` with the tail's bytes
counted net of what the chunk hit loads anyway (with ``C = 0`` the two are the same).
The key lists come from ``daemon/lookup/plan.py``'s ``LookupPlan.load_keys`` -- exactly what vLLM
loads -- so the model follows any geometry. Bytes are full-size (unscaled) per key, all
tensor-parallel ranks together: pass the engine's real geometry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.daemon.base import Geometry
from kvoffload.daemon.lookup.plan import LookupPlan, plan_for

PREFILL_TOKENS_PER_S = 10_000.0  # hybrid 27B on one H200 (workloads.md)
COPY_BYTES_PER_S = 50e9  # pinned host-to-device, PCIe Gen5 x16


@dataclass(frozen=True)
class TimeModel:
    prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S
    copy_bytes_per_s: float = COPY_BYTES_PER_S

    def ttft(self, recomputed_tokens: int, loaded_bytes: int) -> float:
        """Seconds to first token: recompute what missed, copy what hit (no queueing)."""
        return (recomputed_tokens / self.prefill_tokens_per_s
                + loaded_bytes / self.copy_bytes_per_s)


class TailCost:
    """Tail admission and load decisions for one engine geometry under one time model."""

    def __init__(self, geometry: Geometry, model: TimeModel | None = None) -> None:
        self.geometry = geometry
        self.model = model or TimeModel()
        self.plan: LookupPlan = plan_for(geometry)
        tp = geometry.tp_world_size
        self._group_bytes = [g.bytes_per_block * geometry.blocks_per_chunk * tp
                             for g in geometry.groups]
        self._block = geometry.groups[0].tokens_per_block

    def key_bytes(self, key: bytes) -> int:
        """Bytes one load of ``key`` moves (its group's block, every TP rank)."""
        return self._group_bytes[self.geometry.group_pos(key)]

    def load_bytes(self, keys: Sequence[bytes]) -> int:
        return sum(self._group_bytes[self.geometry.group_pos(k)] for k in keys)

    def _pays(self, hashes: Sequence[bytes], local: int, chunk: int, hit: int,
              boundary: int) -> bool:
        with_tail = self.load_bytes(self.plan.load_keys(hashes, local, hit, boundary))
        without = self.load_bytes(self.plan.load_keys(hashes, local, chunk, None)) if chunk else 0
        m = self.model
        return (hit - chunk) / m.prefill_tokens_per_s > (with_tail - without) / m.copy_bytes_per_s

    def load_tail(self, hashes: Sequence[bytes], local: int, chunk_tokens: int,
                  hit_tokens: int, tail_boundary: int | None) -> bool:
        """Load decision: take the tail of a lookup answer, or fall back to its chunk hit
        (``chunk_tokens``, whose keys ``LookupPlan.load_keys(..., None)`` gives)."""
        if tail_boundary is None:
            return False
        return self._pays(hashes, local, chunk_tokens, hit_tokens, tail_boundary)

    def admit_tail(self, boundary: int) -> bool:
        """Admission: store a tail at ``boundary`` only if a later hit on it would pay, against
        the complete chunks below it (stored by the same policy) and nothing computed locally."""
        if boundary % self._block == 0:
            return True  # not a tail: a complete chunk
        tph = self.geometry.tokens_per_hash
        # Only key positions matter for which keys load, so placeholder hashes do.
        hashes = [i.to_bytes(4, "big") for i in range(boundary // tph)]
        chunk = boundary - boundary % self._block
        if self.plan.align_tokens:
            chunk -= chunk % self.plan.align_tokens
        return self._pays(hashes, 0, chunk, boundary, boundary)

    def threshold_tokens(self, complete_chunks: bool) -> float:
        """Fewest tail tokens that pay (for reports): with or without a chunk hit below."""
        b = self._block
        boundary = b + self.geometry.tokens_per_hash if complete_chunks else self.geometry.tokens_per_hash
        hashes = [i.to_bytes(4, "big") for i in range(2 * b // self.geometry.tokens_per_hash)]
        chunk = b if complete_chunks else 0
        extra = self.load_bytes(self.plan.load_keys(hashes, 0, boundary, boundary))
        if chunk:
            extra -= self.load_bytes(self.plan.load_keys(hashes, 0, chunk, None))
        return extra / self.model.copy_bytes_per_s * self.model.prefill_tokens_per_s
