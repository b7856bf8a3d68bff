"""The entries an engine's ``IndexView`` read, as keys and their hashes, without a Python loop.

A burst of another engine's commits in the view's own namespace is thousands of READY entries
to add (``index_view.py``: ``REFRESH_AT_LEAST`` of them in every step). Slicing each key out of
the entries' bytes and putting it in the READY table one at a time cost ~1.7-2.4 µs a key (a
million slots, 2 loaded cores); here the keys of one length come out of one copy (``numpy``'s
``V<n>`` items are ``bytes``: unlike ``S<n>`` ones, no trailing NUL is stripped) and their
hashes out of one ``map``, so that what only adds keys goes to ``ReadyTable.put_many`` at once.
"""

from __future__ import annotations

import numpy as np


def keys_of(rows: np.ndarray) -> list[bytes]:
    """Each entry's key, its first ``keylen`` bytes (``keylen > 0``: entries of ours): one
    copy per distinct key length (the keys of a namespace share one)."""
    fields = rows.dtype.fields
    assert fields is not None  # entries: a structured dtype
    field, start = fields["key"][:2]
    lens = np.minimum(rows["keylen"], field.itemsize)  # a longer one is no key of ours
    entries = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.dtype.itemsize)
    first = int(lens[0])
    if (lens == first).all():
        return _cut(entries[:, start:start + first])
    keys: list[bytes] = []
    at: list[int] = []
    for n in set(lens.tolist()):
        rows_n = np.nonzero(lens == n)[0]
        keys += _cut(entries[rows_n, start:start + n])
        at += rows_n.tolist()
    return [keys[i] for i in np.argsort(np.array(at)).tolist()]


def _cut(keys: np.ndarray) -> list[bytes]:
    """Rows of key bytes (one length) as ``bytes``: ``V<n>`` items, NULs and all."""
    if not keys.shape[1]:
        return [b""] * len(keys)  # no ``V0`` items: numpy drops them
    return np.ascontiguousarray(keys).view(f"V{keys.shape[1]}").reshape(-1).tolist()


def hashes_of(keys: list[bytes]) -> np.ndarray:
    """``hash(key)`` of each (what ``ReadyTable.find`` computes; each ``bytes`` keeps its
    hash, so the per-key path that follows pays nothing more for it)."""
    return np.fromiter(map(hash, keys), dtype=np.int64, count=len(keys))


def alone(values: np.ndarray) -> np.ndarray:
    """Which of ``values`` no other one equals (sorted by hand: ``np.unique`` would do more;
    equal ones are rare, so one sort tells first whether there are any)."""
    single = np.ones(len(values), dtype=np.bool_)
    if len(values) > 1 and np.count_nonzero((s := np.sort(values))[1:] == s[:-1]):
        order = np.argsort(values)
        same = values[order[1:]] == values[order[:-1]]
        single[order[1:][same]] = False
        single[order[:-1][same]] = False
    return single
