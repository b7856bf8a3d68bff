"""What the manager knows about a request, for self-describing store events.

vLLM's manager API hands over keys and a ``ReqContext`` (request id, each key's end-token
position). The token ids, fine hashes and LoRA name that make a daemon event self-describing
come from the ``Request`` objects that ``KVOffloadConnector`` passes along through the
connector API (``on_new_request``). With the stock connector they are unknown, and the daemon
completes payloads from the engine's own KV-event stream where one is configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvoffload.daemon.control import protocol as p


@dataclass
class RequestInfo:
    block_hashes: Any  # vLLM's list, read in place (it grows as the request does)
    token_ids: Any  # vLLM's all_token_ids, read in place
    num_prompt_tokens: int
    lora_name: str | None = None

    @classmethod
    def of(cls, request: Any) -> RequestInfo:
        lora = getattr(request, "lora_request", None)
        return cls(block_hashes=request.block_hashes, token_ids=request.all_token_ids,
                   num_prompt_tokens=request.num_prompt_tokens,
                   lora_name=lora.lora_name if lora is not None else None)

    def store_item(self, key: bytes, end: int, block: int, tokens_per_hash: int) -> p.StoreItem:
        """A key whose state ends at token ``end``: a complete chunk covers its block, a
        partial tail the tokens since the block edge."""
        tail = end % block != 0
        start = (end // block) * block if tail else end - block
        first = start // tokens_per_hash
        return p.StoreItem(
            key=key, end_token=end, tail=tail,
            token_ids=list(self.token_ids[start:end]),
            block_hashes=list(self.block_hashes[first:end // tokens_per_hash]),
            parent_hash=self.block_hashes[first - 1] if start else None,
            lora_name=self.lora_name)


def store_item(key: bytes, end: int | None, block: int, tokens_per_hash: int,
               info: RequestInfo | None) -> p.StoreItem:
    if info is None or not end:
        end_token = end or 0
        return p.StoreItem(key=key, end_token=end_token, tail=end_token % block != 0)
    return info.store_item(key, end, block, tokens_per_hash)
