"""The longest usable offload hit of one request: complete chunks, then a partial tail.

Pure functions, no I/O. The semantics are those of vLLM 0.33.0's scheduler-side offloading
lookup (``OffloadingConnectorScheduler._lookup``), restricted to what the daemon can see:
no EAGLE draft groups, no per-step token budget (``max_num_new_tokens``), no per-request
``max_load_tokens`` and no "chunks already being loaded" delay (scheduler-local state).
Matching vLLM exactly matters: the plugin answers vLLM's per-key ``lookup`` calls from one
batched daemon answer, so any difference is a hit vLLM will not take, or a load of a key the
daemon never pinned. ``tests/daemon/lookup/test_plan.py`` checks this against vLLM's own scheduler.

Groups are identified by their position in ``Geometry.groups``; that position is also the
group index packed into keys (see ``types.make_key``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from kvoffload.daemon.base import Geometry, GroupKind, make_key
from kvoffload.daemon.lookup.query import (  # noqa: F401 - re-exported: callers use lookup.X
    _HIT,
    _MISS,
    _PENDING,
    GroupPlan,
    LookupOutcome,
    LookupQuery,
    Probe,
    _cdiv,
    _Scratch,
    _tail_ok,
    _unique,
    chunk_keys,
    tail_key,
)


class LookupPlan:
    """Everything about a geometry the lookup needs, precomputed (cache it per geometry)."""

    __slots__ = (
        "geometry",
        "groups",
        "tokens_per_hash",
        "blocks_per_chunk",
        "lookup_order",
        "window_order",
        "align_tokens",
        "tail_block_tokens",
    )

    def __init__(self, geometry: Geometry) -> None:
        tph = geometry.tokens_per_hash
        bpc = geometry.blocks_per_chunk
        if tph <= 0 or bpc <= 0 or not geometry.groups:
            raise ValueError("geometry needs groups, tokens_per_hash > 0, blocks_per_chunk > 0")
        groups: list[GroupPlan] = []
        for idx, spec in enumerate(geometry.groups):
            tpb = spec.tokens_per_block
            if tpb <= 0 or tpb % tph:
                raise ValueError(
                    f"group {idx}: tokens_per_block {tpb} is not a multiple of "
                    f"tokens_per_hash {tph}"
                )
            tpc = tpb * bpc
            window: int | None = None
            sw_tokens = 0
            if spec.kind is GroupKind.SLIDING_WINDOW:
                if not spec.sliding_window_tokens or spec.sliding_window_tokens <= 0:
                    raise ValueError(f"group {idx}: sliding window needs sliding_window_tokens")
                sw_tokens = spec.sliding_window_tokens
                # vLLM: max(cdiv(w, tpc), cdiv(w - 1 + extra_retained, tpc)); we model no
                # extra retained tokens (multi-module spec decoding), so it is cdiv(w, tpc).
                window = _cdiv(sw_tokens, tpc)
            elif spec.kind is GroupKind.MAMBA:
                window = 1  # a recurrent group needs one state, the last chunk
            groups.append(
                GroupPlan(
                    index=idx,
                    suffix=make_key(b"", geometry.group_id(idx)),
                    tokens_per_block=tpb,
                    tokens_per_chunk=tpc,
                    hashes_per_chunk=tpc // tph,
                    window_chunks=window,
                    sliding_window_tokens=sw_tokens,
                    is_mamba=spec.kind is GroupKind.MAMBA,
                    cow=spec.kind is GroupKind.MAMBA and spec.mamba_align,
                )
            )
        self.geometry = geometry
        self.groups: tuple[GroupPlan, ...] = tuple(groups)
        self.tokens_per_hash = tph
        self.blocks_per_chunk = bpc
        full = [g.index for g in groups if g.window_chunks is None]
        windowed = [g.index for g in groups if g.window_chunks is not None]
        # vLLM scans windowed groups widest first; sort() is stable, so ties keep config order.
        windowed.sort(key=lambda i: groups[i].window_chunks or 0, reverse=True)
        self.lookup_order: tuple[int, ...] = tuple(full + windowed)
        self.window_order: tuple[int, ...] = tuple(windowed)
        aligns = {g.tokens_per_chunk for g in groups if g.cow}
        if len(aligns) > 1:
            raise ValueError("Mamba align groups disagree on their chunk size")
        self.align_tokens: int | None = aligns.pop() if aligns else None
        self.tail_block_tokens = groups[0].tokens_per_block if _tail_ok(geometry) else 0

    @property
    def supports_partial_tail(self) -> bool:
        return self.tail_block_tokens > 0

    # ------------------------------------------------------------------ lookup

    def lookup(self, query: LookupQuery, probe: Probe) -> LookupOutcome:
        hashes = query.block_hashes
        tph = self.tokens_per_hash
        if len(hashes) < query.num_tokens // tph:
            # vLLM hashes every complete unit of the request before asking.
            raise ValueError(f"{len(hashes)} block hashes cannot cover {query.num_tokens} tokens")
        s = _Scratch(len(self.groups))
        local = query.local_tokens
        complete = self._complete_chunks(query, probe, s)
        if complete is None:
            return LookupOutcome(None, 0, None, [], _unique(s.deferred), s.probes)
        # A deferral overruled by a later miss left keys behind; they caused nothing.
        s.deferred.clear()
        hit: int | None = complete
        boundary: int | None = None
        if self.tail_block_tokens:
            hit, boundary = self._partial_tail(query, complete, probe, s)
            if hit is None:
                return LookupOutcome(None, 0, None, [], _unique(s.deferred), s.probes)
        keys = self.load_keys(hashes, local, hit, boundary) if hit else []
        return LookupOutcome(hit, complete, boundary, keys, [], s.probes)

    def _complete_chunks(self, query: LookupQuery, probe: Probe, s: _Scratch) -> int | None:
        """vLLM's _lookup_complete_chunks: full groups prefix-scan, windowed groups
        suffix-scan, repeated until the hit stops shrinking. 0 = no hit, None = deferred."""
        hashes = query.block_hashes
        n_hashes = len(hashes)
        local = query.local_tokens
        max_hit = query.num_tokens
        if self.window_order:
            # With a windowed group vLLM always recomputes the last token, and a Mamba
            # align group can only resume from a state at one of its chunk edges.
            max_hit -= 1
            if self.align_tokens is not None:
                max_hit -= max_hit % self.align_tokens
        num_hit = 0
        defer = False
        todo = self.lookup_order
        while todo:
            looked_up_window = False
            current, todo = todo, ()
            for gi in current:
                g = self.groups[gi]
                tpc = g.tokens_per_chunk
                n_keys = n_hashes // g.hashes_per_chunk
                max_hit = min(max_hit, n_keys * tpc)
                if max_hit - local < tpc:
                    return 0
                stop = min(_cdiv(max_hit, tpc), n_keys)
                start = local // tpc
                if g.window_chunks is None:
                    count, waiting = self._prefix_scan(g, hashes, start, stop, probe, s)
                    s.hit_end[gi] = start + (0 if waiting else count)
                else:
                    candidate_end = min(max_hit, stop * tpc)
                    count, waiting = self._suffix_scan(
                        g, hashes, start, stop, self._first_window(g, candidate_end), probe, s
                    )
                if waiting:
                    defer = True
                    s.deferred.extend(waiting)
                elif count == 0:
                    return 0
                else:
                    max_hit = min(max_hit, tpc * (start + count))
                new_hit = max_hit - local
                if new_hit < tpc:
                    return 0
                if new_hit < num_hit:
                    if defer:
                        # The boundary moved left: re-ask every group, the deferral
                        # may have come from keys that are now out of range.
                        defer = False
                        s.deferred.clear()
                        todo = self.lookup_order
                    elif looked_up_window and not todo:
                        todo = self.window_order
                looked_up_window |= g.window_chunks is not None
                num_hit = new_hit
        return None if defer else num_hit

    @staticmethod
    def _first_window(g: GroupPlan, candidate_end: int) -> int:
        """Chunks the rightmost run needs (vLLM's load_window_size_in_chunks)."""
        window = g.window_chunks or 0
        if g.sliding_window_tokens:
            # The window ends at the real boundary, possibly inside the last chunk.
            padding = -candidate_end % g.tokens_per_chunk
            window = max(window, _cdiv(g.sliding_window_tokens - 1 + padding, g.tokens_per_chunk))
        return window

    @staticmethod
    def _prefix_scan(
        g: GroupPlan, hashes: Sequence[bytes], start: int, stop: int, probe: Probe, s: _Scratch
    ) -> tuple[int, list[bytes] | None]:
        """Consecutive hits from chunk ``start``; RETRY does not stop the scan (vLLM lets
        the manager start every slow lookup at once), MISS does."""
        hits = 0
        waiting: list[bytes] | None = None
        step = g.hashes_per_chunk
        suffix = g.suffix
        for pos in range(step * (start + 1) - 1, step * stop, step):
            key = hashes[pos] + suffix
            status = probe(key)
            s.probes += 1
            if status == _HIT:
                hits += 1
            elif status == _MISS:
                break
            else:
                if status == _PENDING:
                    hits += 1
                if waiting is None:
                    waiting = []
                waiting.append(key)
        return hits, waiting

    @staticmethod
    def _suffix_scan(
        g: GroupPlan,
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        first_window: int,
        probe: Probe,
        s: _Scratch,
    ) -> tuple[int, list[bytes] | None]:
        """vLLM's _sliding_window_lookup: scanning from the right, the end (relative to
        ``start``) of the rightmost run of ``window`` consecutive hits; the first run may
        need ``first_window``. A run starting at ``start`` may be shorter."""
        window = g.window_chunks or 1
        need = first_window or window
        run = 0
        retried: list[bytes] | None = None  # a RETRY anywhere right of the answer defers it
        run_pending: list[bytes] | None = None  # HIT_PENDING inside the current run
        step = g.hashes_per_chunk
        suffix = g.suffix
        for rel in range(stop - start - 1, -1, -1):
            key = hashes[step * (start + rel + 1) - 1] + suffix
            status = probe(key)
            s.probes += 1
            if status == _HIT:
                run += 1
            elif status == _PENDING:
                run += 1
                if run_pending is None:
                    run_pending = []
                run_pending.append(key)
            else:
                if status != _MISS:
                    if retried is None:
                        retried = []
                    retried.append(key)
                run = 0
                run_pending = None
                need = window
            if run == need:
                return rel + need, (retried or []) + (run_pending or []) or None
        return run, (retried or []) + (run_pending or []) or None

    def _partial_tail(
        self, query: LookupQuery, complete: int, probe: Probe, s: _Scratch
    ) -> tuple[int | None, int | None]:
        """vLLM's partial-tail search above the complete hit. Returns (hit, boundary)."""
        hashes = query.block_hashes
        tph = self.tokens_per_hash
        block = self.tail_block_tokens
        local = query.local_tokens
        complete_boundary = local + complete
        max_boundary = min(query.num_prompt_tokens - 1, complete_boundary + block - 1)
        max_boundary -= max_boundary % tph
        if max_boundary <= complete_boundary:
            return complete, None
        groups = self.groups
        # Only reachable when complete_boundary is not block aligned: a boundary at or past
        # the next block edge also loads that block's complete chunk (the "bridge").
        bridge_chunk = complete_boundary // block
        bridge_boundary = (bridge_chunk + 1) * block
        pending: list[bytes] = []
        bridge_pending: list[bytes] = []
        if max_boundary >= bridge_boundary:
            for g in groups:
                if g.cow or s.hit_end[g.index] > bridge_chunk:
                    continue  # recurrent groups load only the tail; confirmed chunks skip
                key = hashes[g.hashes_per_chunk * (bridge_chunk + 1) - 1] + g.suffix
                status = probe(key)
                s.probes += 1
                if status == _MISS:
                    max_boundary = bridge_boundary - tph
                    break
                if status != _HIT:
                    bridge_pending.append(key)
            pending.extend(bridge_pending)
        for boundary in range(max_boundary, complete_boundary, -tph):
            carried = bridge_pending if boundary >= bridge_boundary else None
            waiting: list[bytes] | None = list(carried) if carried else None
            key_pos = boundary // tph - 1
            missed = False
            for g in groups:
                key = hashes[key_pos] + g.suffix
                status = probe(key)
                s.probes += 1
                if status == _MISS:
                    missed = True
                    break
                if status != _HIT:
                    if waiting is None:
                        waiting = []
                    waiting.append(key)
            if not missed and not waiting:
                return boundary - local, boundary
            if waiting:
                pending.extend(waiting)
        if pending and complete == 0:
            s.deferred.extend(pending)
            return None, None
        return complete, None

    # -------------------------------------------------------------- load keys

    def load_keys(
        self, block_hashes: Sequence[bytes], local: int, hit: int, boundary: int | None
    ) -> list[bytes]:
        """Keys vLLM's update_state_after_alloc passes to prepare_load for this hit.

        Per group in config order: its chunk keys from the first block it must fill, then
        its tail key. Which blocks a group fills follows vLLM's allocation: full attention
        every block after the local prefix; a sliding window only blocks still inside the
        window; Mamba only the block holding the last hit token (one state). Assumes an
        asynchronous load and a block-aligned ``local`` (vLLM asserts the latter).
        """
        total = local + hit
        keys: list[bytes] = []
        tph = self.tokens_per_hash
        bpc = self.blocks_per_chunk
        for g in self.groups:
            tpb = g.tokens_per_block
            num_blocks = _cdiv(total, tpb)
            if g.is_mamba:
                skipped = total - 1
            elif g.sliding_window_tokens:
                skipped = max(0, total - g.sliding_window_tokens + 1)
            else:
                skipped = 0
            first = max(_cdiv(local, tpb), skipped // tpb)
            if first >= num_blocks:
                continue
            step = g.hashes_per_chunk
            end_chunk = _cdiv(total, g.tokens_per_chunk) - (boundary is not None)
            suffix = g.suffix
            for pos in range(step * (first // bpc + 1) - 1, step * end_chunk, step):
                keys.append(block_hashes[pos] + suffix)
            if boundary is not None:
                keys.append(block_hashes[boundary // tph - 1] + suffix)
        return keys


@lru_cache(maxsize=256)
def plan_for(geometry: Geometry) -> LookupPlan:
    """The cached plan of a geometry (geometries are few and immutable)."""
    return LookupPlan(geometry)


def supports_partial_tail(geometry: Geometry) -> bool:
    """Whether vLLM 0.33 looks up partial tails for engines of this geometry (DCP aside)."""
    return _tail_ok(geometry)


def lookup(geometry: Geometry | LookupPlan, query: LookupQuery, probe: Probe) -> LookupOutcome:
    """The longest hit vLLM 0.33's scheduler would take, probing keys through ``probe``."""
    plan = geometry if isinstance(geometry, LookupPlan) else plan_for(geometry)
    return plan.lookup(query, probe)
