"""The READY keys of an engine's view, in flat arrays: no Python object per key.

An engine's ``IndexView`` used to keep its READY keys in dicts (``key -> (slot, ident)`` and
``slot -> key``): about 314 B per key, 314 MB per engine at a million blocks, once per engine on
the node (issue 24). ``ReadyTable`` keeps, instead,

* an open-addressing hash table of ``2^k >= 2 * num_slots`` buckets, linear probing, each
  bucket a key's 64-bit hash (``hash(bytes)``: this process's own SipHash, computed once per
  key object) and the pool slot that holds it, with backward-shift deletion (tombstones only
  for a burst of drops, and only until ``purge``: probe runs stay short however long the
  engine runs), and
* per pool slot: the bucket of its key (or -1), the writer generation it was READY at, and
  whether the daemon declines to serve it (``FLAG_NOT_WORTH``).

That is 12 B per bucket and 9 B per slot: ~33 B per slot at any fill, so at most ~33 B per
READY key once the pool is full of this namespace's keys (more per key when it is not, but
never more in all).

**Many drops at once** (``drop_many``: a burst of evictions in this namespace, which the view
applies in the step it reads them, ``index_view.py``) are vectorized: their buckets become
*tombstones* (a hash no key has, a slot number no slot has), ~5 ns each instead of a ~1 µs
backward-shift deletion each. A probe passes over a tombstone; ``purge`` empties them (one
backward shift each) a window of buckets at a time within the refresh's budget, and at once
when they would fill a quarter of the buckets, so the table never fills and probe runs stay
short. A lookup is a hash and a probe or two through memoryviews, ~140 ns more
than a dict probe here (``kvoffload bench --suite lookup`` reports what it costs a step).

**Many puts at once** (``put_many``: a burst of another engine's commits in this namespace,
which the view adds a chunk of slots at a time, ``index_view.py``) take the keys' hashes
computed by the caller and probe for all of them in lockstep, one bucket per round, a few
rounds vectorized and the few keys left one by one: ~0.4 µs a key in a chunk of 256 at a
million slots, against ~0.9 µs for a loop of ``put`` (2 loaded cores; both mostly cache
misses in the buckets). Lookups are unchanged.

**Why a hash and no key bytes.** Two keys whose hashes are equal are taken as one key. A
lookup answers (slot, ident) with the ident built from the key *asked for*
(``shared_index.ident``: generation and a CRC-32 tag of the key), not from the table, and
every load's worker checks that ident against the slot's own ident word after the copy
(``SlotGenerations.intact_mask``). So a false hit needs a 64-bit SipHash collision between two
keys of one namespace *and* a CRC-32 collision between the same two keys: the load of another
block then fails its check in all but ~2^-96 of the cases where the first, itself ~n * 2^-64
per lookup, happens. A collision in the table alone makes one key read as missing: vLLM
computes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from time import perf_counter

import numpy as np
from kvoffload.daemon.store import shared_index as si

_EMPTY = -1
# A tombstone's hash: ``hash()`` never returns -1 (CPython maps it to -2), so no key matches.
_TOMB = -1
_PURGE_WINDOW = 1 << 14  # buckets scanned per purge step (one vectorized compare, ~5 µs)
_PURGE_AT_LEAST = 32  # tombstones emptied per call whatever the deadline: purging progresses
_VECTOR_ROUNDS = 2  # lockstep probe rounds of put_many before the few keys left go one by one


def _finder(mask: int, hashes: memoryview, slots: memoryview) -> Callable[[bytes], int]:
    def find(key: bytes) -> int:
        h = hash(key)
        i = h & mask
        while True:
            slot = slots[i]
            if slot < 0 or hashes[i] == h:
                return slot
            i = (i + 1) & mask
    return find


class ReadyTable(Mapping[bytes, tuple[int, int]]):
    """``key -> (slot, ident)`` for one namespace's READY blocks, keyed by ``hash(key)``.

    ``key_at(slot)`` reads a slot's key back from the shared table; only iteration (tests,
    tools) uses it: what is iterated is what the view applied, keys as the table holds them
    now (a slot rewritten since the view's last refresh is left out)."""

    def __init__(self, num_slots: int, key_at: Callable[[int], bytes | None]) -> None:
        cap = 1 << max(4, (2 * max(1, num_slots) - 1).bit_length())
        self._mask = cap - 1
        # Every array written here, not left to the kernel's zero pages: the first write to a
        # page (numpy asks for 2 MB ones) would fault it in on the step of a burst's first
        # keys, ~1 ms at a million slots; at attach it is the attach thread's.
        self._hashes = np.full(cap, 0, dtype=np.int64)
        self._slots = np.full(cap, _EMPTY, dtype=np.int32)
        # One more than the slots: a tombstone's slot number (``num_slots``) has an entry too,
        # which the backward shift may write when it moves a tombstone, and nothing reads.
        self._tomb_slot = num_slots
        self._bucket = np.full(num_slots + 1, _EMPTY, dtype=np.int32)
        self._gen = np.full(num_slots, 0, dtype=np.uint32)
        self._declined = np.full(num_slots, False, dtype=np.bool_)
        # Element access through memoryviews: a Python int in ~25 ns, numpy scalars ~80 ns.
        self._h, self._s = self._hashes.data, self._slots.data
        self._b, self._g, self._d = self._bucket.data, self._gen.data, self._declined.data
        self._count = 0
        self.tombs = 0  # tombstones left by drop_many, emptied by purge
        self._scan = 0  # the next bucket window purge looks at (cyclic)
        self._key_at = key_at
        # ``find(key)``: the slot holding ``key`` READY, or -1. A closure, not a method: the
        # lookup path's cost is this probe, and a closure reads its arrays without attribute
        # lookups.
        self.find: Callable[[bytes], int] = _finder(self._mask, self._h, self._s)

    # -- reading (the lookup path) ----------------------------------------------------------

    def declined(self, slot: int) -> bool:
        """The daemon flagged the tail in ``slot`` not worth its load (``FLAG_NOT_WORTH``)."""
        return bool(self._d[slot])

    @property
    def declined_flags(self) -> memoryview:
        """``declined`` per slot, for the lookup path to index without a call."""
        return self._d

    def holds(self, slot: int) -> bool:
        return self._b[slot] >= 0

    def get(self, key: bytes, default: object = None) -> tuple[int, int] | None:  # type: ignore[override]
        slot = self.find(key)
        if slot < 0:
            return default  # type: ignore[return-value]
        return slot, si.ident(self._g[slot], key)

    def __getitem__(self, key: bytes) -> tuple[int, int]:
        got = self.get(key)
        if got is None:
            raise KeyError(key)
        return got

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.find(key) >= 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[bytes]:
        for slot in np.nonzero(self._bucket[:self._tomb_slot] >= 0)[0].tolist():
            key = self._key_at(slot)
            if key is not None and self.find(key) == slot:
                yield key

    # -- writing (the view's refresh) -------------------------------------------------------

    def put(self, slot: int, key: bytes, gen: int, declined: bool) -> None:
        """``key`` is READY in ``slot`` at ``gen``: whatever the slot held before is replaced,
        and a key that moved here from another slot leaves that one."""
        h = hash(key)
        mine = self._b[slot]
        if mine >= 0 and self._h[mine] != h:
            self._delete(mine)
        self._place(slot, h)
        self._g[slot] = gen & si.GEN_MASK
        self._d[slot] = declined

    def put_many(self, slots: np.ndarray, hashes: np.ndarray, gens: np.ndarray,
                 declined: np.ndarray) -> None:
        """``put`` of many keys at once, given each key's ``hash(key)`` (what ``find``
        computes), in any order: ``slots`` unique, and ``hashes`` unique among them (a key
        twice, or two keys taken as one, must go through ``put`` in order instead).

        The probes are vectorized (``_insert``); only a slot that held another key pays a
        Python deletion, and a key whose probe runs long a Python probe."""
        bucket = self._bucket
        b = bucket[slots]
        held = b >= 0
        if np.count_nonzero(held):
            other = held.copy()
            other[held] = self._hashes[b[held]] != hashes[held]
            for slot in slots[other].tolist():  # rewritten with another key: rare
                self._delete(self._b[slot])  # re-read: a deletion shifts entries back
            b = bucket[slots]
        new = (b < 0).nonzero()[0]  # a slot that holds its key already keeps its bucket
        if len(new):
            self._insert(slots[new], hashes[new])
        self._gen[slots] = gens & si.GEN_MASK
        self._declined[slots] = declined

    def _insert(self, slots: np.ndarray, hashes: np.ndarray) -> None:
        """Probe for ``hashes`` (unique) in lockstep, one bucket per round for all: a key
        found holds its new slot (it moved; the old slot no longer holds it), a key at an
        empty bucket takes it. Keys that meet at one empty bucket: one takes it (whichever
        write landed), the others probe on, as they would after it in a loop of ``put``. An
        empty bucket ends every probe that reaches it, so no probe has passed one that
        another fills here. After ``_VECTOR_ROUNDS`` the few keys left probe one by one."""
        mask, hashes_at, slots_at, bucket = self._mask, self._hashes, self._slots, self._bucket
        pos = hashes & mask
        for _ in range(_VECTOR_ROUNDS):
            at = slots_at[pos]
            free = at < 0
            done = hashes_at[pos] == hashes
            done &= ~free  # an empty bucket's hash word is no key's
            if np.count_nonzero(done):
                p = pos[done]
                bucket[at[done]] = _EMPTY
                slots_at[p] = slots[done]
                bucket[slots[done]] = p
            fi = free.nonzero()[0]
            if len(fi):
                p, s = pos[fi], slots[fi]
                slots_at[p] = s
                won = slots_at[p] == s  # of keys at one bucket, the one whose write landed
                fi, p, s = fi[won], p[won], s[won]
                hashes_at[p] = hashes[fi]
                bucket[s] = p
                self._count += len(fi)
                done[fi] = True
            left = (~done).nonzero()[0]
            if not len(left):
                return
            slots, hashes, pos = slots[left], hashes[left], (pos[left] + 1) & mask
        for slot, h in zip(slots.tolist(), hashes.tolist(), strict=True):
            self._place(slot, h)

    def _place(self, slot: int, h: int) -> None:
        """Probe for ``h`` from its home bucket: a key found there moved to ``slot`` (its old
        slot no longer holds it), else ``slot`` takes the first empty bucket."""
        mask, hashes, slots, bucket = self._mask, self._h, self._s, self._b
        i = h & mask
        while True:
            held = slots[i]
            if held < 0:
                hashes[i], slots[i] = h, slot
                self._count += 1
                break
            if hashes[i] == h:
                if held != slot:
                    bucket[held] = _EMPTY  # the key moved: its old slot no longer holds it
                    slots[i] = slot
                break
            i = (i + 1) & mask
        bucket[slot] = i

    def drop(self, slot: int) -> None:
        """``slot`` holds no READY key of ours any more."""
        i = self._b[slot]
        if i >= 0:
            self._delete(i)

    def holding(self, slots: np.ndarray) -> np.ndarray:
        """Which of ``slots`` hold a READY key (vectorized ``holds``)."""
        return self._bucket[slots] >= 0

    def absent(self, hashes: np.ndarray) -> np.ndarray:
        """Which of ``hashes`` (``hash(key)`` each) no READY key has: ``find(key) < 0``
        for all at once, probes in lockstep. A probe still running after
        ``_VECTOR_ROUNDS`` answers False (maybe held): the caller's per-key path decides."""
        mask, hashes_at, slots_at = self._mask, self._hashes, self._slots
        out = np.zeros(len(hashes), dtype=np.bool_)
        at, pos = np.arange(len(hashes)), hashes & mask
        for _ in range(_VECTOR_ROUNDS):
            held = slots_at[pos]
            out[at[held < 0]] = True  # an empty bucket ends the probe (a tombstone does not)
            on = (held >= 0) & (hashes_at[pos] != hashes)
            if not np.count_nonzero(on):
                break
            at, hashes, pos = at[on], hashes[on], (pos[on] + 1) & mask
        return out

    def drop_many(self, slots: np.ndarray) -> None:
        """``slots`` (unique) hold no READY key of ours any more: vectorized, their buckets
        become tombstones that probes pass over until ``purge`` empties them."""
        buckets = self._bucket[slots]
        held = buckets >= 0
        if not held.any():
            return
        buckets = buckets[held]
        self._hashes[buckets] = _TOMB
        self._slots[buckets] = self._tomb_slot  # >= 0: a probe goes on past it
        self._bucket[slots[held]] = _EMPTY
        self._count -= len(buckets)
        self.tombs += len(buckets)
        if self.tombs >= len(self._hashes) // 4:
            # Live keys fill at most half the buckets: with under a quarter tombstones an
            # empty bucket always ends a probe. Rare (a quarter of the table evicted between
            # two purges' worth of steps), so this one step pays for all of them.
            self.purge(float("inf"))

    def purge(self, deadline: float) -> None:
        """Empty tombstones until ``deadline`` (``time.perf_counter``; a few whatever it is),
        a window of buckets at a time, cyclically: a backward shift may move a tombstone into
        a bucket already passed, and a later round finds it there."""
        hashes, cap = self._hashes, len(self._hashes)
        done = 0
        while self.tombs:
            lo = self._scan
            found = np.nonzero(hashes[lo:lo + _PURGE_WINDOW] == _TOMB)[0]
            # From the top down: a shift moves entries from higher buckets into the hole, so
            # the tombstones still to do in this window stay where they were found.
            for n, i in enumerate(found[::-1].tolist()):
                if self._h[lo + i] == _TOMB:
                    self._unlink(lo + i)
                    self.tombs -= 1
                    done += 1
                if n % 16 == 15 and done >= _PURGE_AT_LEAST and perf_counter() >= deadline:
                    return  # this window again next time: what is left in it is found again
            self._scan = (lo + _PURGE_WINDOW) % cap
            if done >= _PURGE_AT_LEAST and perf_counter() >= deadline:
                return

    def _delete(self, i: int) -> None:
        """Empty bucket ``i`` of a live key (see ``_unlink``)."""
        self._b[self._s[i]] = _EMPTY
        self._count -= 1
        self._unlink(i)

    def _unlink(self, i: int) -> None:
        """Empty bucket ``i``; later entries of its probe run shift back so that every entry
        stays reachable from its home bucket (a tombstone moves like an entry: nothing looks
        for it)."""
        mask, hashes, slots, bucket = self._mask, self._h, self._s, self._b
        j = i
        while True:
            j = (j + 1) & mask
            slot = slots[j]
            if slot < 0:
                break
            home = hashes[j] & mask
            # The entry at j stays when its home lies cyclically in (i, j]: the hole at i is
            # before its home, and it would be unreachable there.
            if (i < home <= j) if i <= j else (home > i or home <= j):
                continue
            hashes[i], slots[i] = hashes[j], slot
            bucket[slot] = i
            i = j
        slots[i] = _EMPTY
        hashes[i] = 0

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self._hashes, self._slots, self._bucket, self._gen,
                                      self._declined))
