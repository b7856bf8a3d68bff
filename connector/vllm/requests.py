"""What the manager knows about a request, for self-describing store events.

vLLM's manager API hands over keys and a ``ReqContext`` (request id, each key's end-token
position). The token ids, fine hashes and LoRA name that make a daemon event self-describing
come from the ``Request`` objects that ``KVOffloadConnector`` passes along through the
connector API (``on_new_request``). With the stock connector they are unknown, and the daemon
completes payloads from the engine's own KV-event stream where one is configured.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.daemon.base import key_group
from kvoffload.daemon.control import protocol as p


@dataclass
class RequestInfo:
    block_hashes: Any  # vLLM's list, read in place (it grows as the request does)
    token_ids: Any  # vLLM's all_token_ids, read in place
    num_prompt_tokens: int
    lora_name: str | None = None
    request: Any = None  # vLLM's Request: whether it finished (its stores are not re-offered)
    # The last span described: every group's key of one boundary covers the same tokens, so
    # their items share one copy of the token ids and hashes.
    _span: tuple[int, int, list[int], list[bytes], bytes | None] | None = field(
        default=None, repr=False)

    @classmethod
    def of(cls, request: Any) -> RequestInfo:
        lora = getattr(request, "lora_request", None)
        return cls(block_hashes=request.block_hashes, token_ids=request.all_token_ids,
                   num_prompt_tokens=request.num_prompt_tokens,
                   lora_name=lora.lora_name if lora is not None else None, request=request)

    def finished(self) -> bool:
        return self.request is not None and bool(self.request.is_finished())

    def store_item(self, key: bytes, end: int, block: int, tokens_per_hash: int) -> p.StoreItem:
        """A key whose state ends at token ``end``: a complete chunk covers its block, a
        partial tail the tokens since the block edge."""
        tail = end % block != 0
        start = (end // block) * block if tail else end - block
        span = self._span
        if span is None or span[0] != start or span[1] != end:
            first = start // tokens_per_hash
            span = self._span = (start, end, list(self.token_ids[start:end]),
                                 list(self.block_hashes[first:end // tokens_per_hash]),
                                 self.block_hashes[first - 1] if start else None)
        return p.StoreItem(key=key, end_token=end, tail=tail, token_ids=span[2],
                           block_hashes=span[3], parent_hash=span[4], lora_name=self.lora_name)


def store_item(key: bytes, end: int | None, block: int, tokens_per_hash: int,
               info: RequestInfo | None) -> p.StoreItem:
    if info is None or not end:
        end_token = end or 0
        return p.StoreItem(key=key, end_token=end_token, tail=end_token % block != 0)
    return info.store_item(key, end, block, tokens_per_hash)


def offered_again(info: RequestInfo | None, keys: Collection[Any], ctx: Any,
                  cow_groups: Collection[int], block: Mapping[int, int]) -> bool:
    """Whether vLLM 0.33 offers ``keys`` again after ``prepare_store`` answered None: complete
    chunks of a request still running, from its regular store path (``_build_store_jobs``
    leaves ``next_stored_chunk_idx`` where it was). Partial tails and copy-on-write states come
    from a hand-off vLLM makes once, a finished request is not asked again, and without the
    request (vLLM's stock connector) nobody can tell."""
    if info is None or info.finished():
        return False
    for key in keys:
        group = key_group(key)
        end = ctx.get_offload_key_position(key)
        if group in cow_groups or not end or end % block.get(group, 1):
            return False
    return True


def lookup_report(block: int, req_id: str, num_tokens: int, num_prompt: int, local: int,
                  hit: int | None, seconds: float) -> p.LookupReport:
    """A request's lookup outcome (``KVOffloadConnector``'s arguments), built at the step's
    end, off vLLM's lookup path; ``block``: the first group's tokens per block."""
    end = local + (hit or 0)
    tail = bool(hit) and end % block != 0
    chunk = max(0, end - end % block - local) if tail else (hit or 0)
    return p.LookupReport(
        req_id=req_id, num_tokens=num_tokens, num_prompt_tokens=num_prompt,
        local_tokens=local, hit_tokens=hit, chunk_tokens=chunk,
        tail_boundary=end if tail else None,
        miss_reason=None if hit else ("pending" if hit is None else "not_stored"),
        latency_us=int(seconds * 1e6))
