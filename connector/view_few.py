"""A refresh of a few ring records, entry by entry: the engine's usual step (``index_view.py``).

Between two steps the daemon usually changes a handful of the view's slots: this engine's own
claims and commits, a grant of reserved slots, another engine's few stores. The vectorized path
costs about the same whatever the count -- ~60-80 numpy calls, 1-5 µs each on a loaded 2-core
host: 0.15-0.2 ms for 10 entries, 0.45-0.6 ms in the whole-step bench, which calls it in about
every third step (issue 24: the whole step, ours over vLLM's). Read one by one with ``struct``
and applied by the view's ordered loop (``IndexView._in_order``, the reference the batched
paths are tested against), the same entries cost a few µs each.

The reads keep the vectorized path's protocol to the letter (docs/architecture.md, "Memory
ordering"): every slot's sequence word, a load-load fence, the entries (64-byte copies), a
fence, the sequence words again; an entry is consistent when the three words agree and are
even. One read mid-write is read again up to ``_RETRIES`` times, then waits in the backlog:
its ring record lies after the head this refresh read, as in ``IndexView._consistent``.

Only when nothing waits in the backlog and the slots are at most ``REFRESH_AT_LEAST``: then
``_take`` too would apply every entry now, so the two paths leave the view alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from kvoffload.connector.ready_table import ReadyTable
from kvoffload.daemon.store import fence
from kvoffload.daemon.store import shared_index as si

REFRESH_FEW = 48  # ring records a refresh reads entry by entry (measured crossover: ~64)
_RETRIES = 4
_SEQ, _ENTRY, _BYTES = si.SEQ.unpack_from, si.ENTRY.unpack, si.ENTRY_BYTES


def ring_records(mm: Any, ring_off: int, cap: int, start: int, head: int) -> list[int]:
    """The slots the ring records at positions ``[start, head)`` name (``head - start < cap``)."""
    lo, hi = start % cap, head % cap
    if lo < hi:
        return list(np.frombuffer(mm, dtype="<u4", count=hi - lo, offset=ring_off + 4 * lo)
                    .tolist())
    first = np.frombuffer(mm, dtype="<u4", count=cap - lo, offset=ring_off + 4 * lo).tolist()
    return first + np.frombuffer(mm, dtype="<u4", count=hi, offset=ring_off).tolist()


class FewEntries:
    """``IndexView``'s entry-by-entry refresh (a mixin: the view owns what it calls)."""

    mm: Any
    ready: ReadyTable
    _pmask: np.ndarray
    namespace: int
    num_slots: int
    torn: int
    _mine: np.ndarray
    backlog: Any
    _in_order: Callable[[list[int], list[bytes], list[int], list[int], list[int]], None]
    _forget: Callable[[np.ndarray], None]

    def _read_few(self, slots: list[int]) -> tuple[list[tuple[int, bytes]], list[int]]:
        """(slot, entry bytes) of ``slots`` read consistently, and the slots caught
        mid-write every time."""
        mm, base = self.mm, si.HEADER_BYTES
        good: list[tuple[int, bytes]] = []
        todo = slots
        for _ in range(_RETRIES + 1):
            offs = [base + s * _BYTES for s in todo]
            seqs = [_SEQ(mm, o)[0] for o in offs]
            fence.load_load()  # the sequence words before the entries ...
            raws = [mm[o:o + _BYTES] for o in offs]
            fence.load_load()  # ... and the entries before the words again
            again = [_SEQ(mm, o)[0] for o in offs]
            torn = []
            for slot, seq, raw, seq2 in zip(todo, seqs, raws, again, strict=True):
                if seq == seq2 and not seq & 1 and _SEQ(raw)[0] == seq:
                    good.append((slot, raw))
                else:
                    torn.append(slot)
            if not torn:
                return good, []
            todo = torn
        return good, todo

    def _take_few(self, slots: list[int]) -> int:
        """``_take`` of a few unique ``slots`` with nothing waiting: every entry applied now,
        in order. Returns how many only added a key (what ``_take`` would count)."""
        good, torn = self._read_few(slots)
        if torn:
            self.torn += len(torn)
            self.backlog.add(np.array(torn, dtype=np.int64))
        ns, mine = self.namespace, self._mine
        lo, hi = si.PENDING, si.READY
        gone: list[int] = []
        ours: list[int] = []
        keys: list[bytes] = []
        idents: list[int] = []
        states: list[int] = []
        flags: list[int] = []
        for slot, raw in good:
            _seq, ens, state, flag, ident, keylen, key = _ENTRY(raw)
            if ens == ns and lo <= state <= hi and keylen > 0:
                ours.append(slot)
                keys.append(key[:keylen])
                idents.append(ident)
                states.append(state)
                flags.append(flag)
            elif mine[slot]:
                gone.append(slot)
        if gone:  # no key of ours any more (evicted, reassigned to another namespace)
            self._forget(np.array(gone, dtype=np.int64))
        if not ours:
            return 0
        ready, pmask = self.ready.holds, self._pmask
        added = sum(1 for slot, state in zip(ours, states, strict=True)
                    if not ready(slot) and (state == hi or not pmask[slot]))
        self._in_order(ours, keys, idents, states, flags)
        mine[ours] = True
        return added
