"""One part of ``DaemonEvents`` kept apart for size: stores whose event waits for a payload.

A store committed without token ids is not announced with a placeholder: it waits (bounded,
counted) in ``_awaiting`` until a payload is known. For a complete chunk the payload comes from
the engines' own GPU streams (``daemon/streams/consume.py``): a GPU block's hash is the last
fine hash inside it, i.e. our chunk key's hash, and a chunk of several engine blocks is
followed back through their parents. Partial tails cannot be completed that way (vLLM only
publishes full blocks): they stay awaiting until evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvoffload.daemon.base import key_group, key_hash
from kvoffload.daemon.store.index import Namespace
from kvoffload.daemon.streams.consume import EngineStreams
from kvoffload.events.hub import StoredRecord
from kvoffload.events.schema import BlockStored, hash_to_int
from prometheus_client import Counter, Gauge

__all__ = ["EngineCompletion"]


class EngineCompletion:
    """Mixin of DaemonEvents: awaiting stores, completed from the engines' streams."""

    int_hashes: bool
    engines: EngineStreams | None
    _awaiting: OrderedDict[int, tuple[Namespace, bytes]]
    _awaiting_by_hash: dict[int, set[int]]
    completed: Counter
    incomplete: Counter
    awaiting_gauge: Gauge

    def _publish_stored(self, slot: int, key: bytes, event: BlockStored,
                        ns: Namespace | None = None, tail: bool = False) -> None:
        raise NotImplementedError  # DaemonEvents publishes

    def _hash(self, h: bytes) -> Any:
        return hash_to_int(h) if self.int_hashes else h

    def _unawait(self, slot: int) -> bool:
        got = self._awaiting.pop(slot, None)
        if got is None:
            return False
        h = hash_to_int(key_hash(got[1]))
        slots = self._awaiting_by_hash.get(h)
        if slots is not None:
            slots.discard(slot)
            if not slots:
                del self._awaiting_by_hash[h]
        return True

    def _engine_block(self, h: int) -> None:
        """An engine announced block `h`: publish the stores that waited for its payload."""
        slots = self._awaiting_by_hash.get(h)
        if not slots:
            return
        for slot in list(slots):
            ns, key = self._awaiting[slot]
            event = self._from_engines(ns, key, slot)
            if event is not None:
                self._unawait(slot)
                self.completed.inc()
                self._publish_stored(slot, key, event, ns)
        self.awaiting_gauge.set(len(self._awaiting))

    def _wire(self, h: Any) -> Any:
        """An engine's hash in our configured form; None when it cannot be (int -> bytes)."""
        if self.int_hashes:
            return hash_to_int(h) if isinstance(h, bytes) else h
        return h if isinstance(h, bytes) else None

    def _from_engines(self, ns: Namespace, key: bytes, slot: int) -> BlockStored | None:
        """The chunk's payload from the engines' GPU blocks ending at the key's hash."""
        if self.engines is None:
            return None
        g = ns.geometry
        group = key_group(key)
        spec = g.groups[g.group_pos(key)]
        need = spec.tokens_per_block * g.blocks_per_chunk
        chain: list[StoredRecord] = []
        h: Any = hash_to_int(key_hash(key))
        have = 0
        while have < need:  # a chunk of several engine blocks: follow parents back
            rec = self.engines.find(h, group)
            if rec is None:
                return None
            chain.append(rec)
            have += len(rec.tokens)
            if have < need:
                if rec.parent is None:
                    return None
                h = hash_to_int(rec.parent) if isinstance(rec.parent, bytes) else rec.parent
        chain.reverse()
        parent = None if chain[0].parent is None else self._wire(chain[0].parent)
        if have != need or (chain[0].parent is not None and parent is None):
            self.incomplete.labels("engine_mismatch").inc()
            return None
        if len(chain) == 1:
            hashes = [self._hash(key_hash(key))]
            block_size = need
        else:
            hashes = [self._wire(r.hashes[0]) for r in chain[:-1]] + [self._hash(key_hash(key))]
            block_size = chain[0].block_size
            if None in hashes or any(r.block_size != block_size for r in chain):
                self.incomplete.labels("engine_mismatch").inc()
                return None
        tokens: list[int] = []
        extra: list[Any] = []
        for r in chain:
            tokens.extend(r.tokens)
            extra.extend(r.extra_keys or (None,))
        return BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
            block_size=block_size, lora_id=None, medium="CPU", lora_name=chain[-1].lora_name,
            extra_keys=extra if len(extra) == len(hashes) and any(extra) else None,
            group_idx=group, kv_cache_spec_kind=spec.kind.value,
            kv_cache_spec_sliding_window=spec.sliding_window_tokens, locality="LOCAL")
