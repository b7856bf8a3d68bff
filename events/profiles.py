"""Router profiles: what the daemon's KV-event stream carries for one kind of consumer.

A profile is a set of rules measured against a real router (docs/events.md, docs/routers.md):

* ``full`` (default): everything we hold, vLLM 0.33's map-form events: complete chunks, partial
  tails (vLLM PR #51243's convention), recurrent-state snapshots, STORAGE, every group.
* ``dynamo`` (checked with ai-dynamo-runtime 1.6.1's ``python -m dynamo.indexer``): only
  full-attention groups (Dynamo would index a Mamba STORAGE block as attention), chunk events at
  the engine's block size (Dynamo drops events whose ``block_size`` differs from the worker's),
  no partial tails unless asked (Dynamo drops them anyway), and never an ``ownership`` field:
  Dynamo 1.6.1's ZMQ path drops every event that carries one, whatever the value.
* ``llm-d`` (checked against llm-d-kv-cache v0.8.1's vLLM adapter): events as positional
  arrays (its parser indexes fields by position and fails a whole batch of map-form events),
  on a topic ``kv@<pod>@<model>`` whose pod names the node tier (``kv@node:<node>@<model>``,
  llm-d-router #2586's pseudo-pod convention). Trailing fields are ignored there, so
  ``ownership`` may be set.

Per-engine views (``--engine-view``) are extra publishers of the same events whose batches
carry one engine's ``data_parallel_rank`` (Dynamo credits a block to the batch's rank), and
that can merge that engine's own GPU stream, so a router indexing per worker credits every
engine that can load our blocks.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Final

from .schema import BlockStored, KVEvent

__all__ = ["PROFILES", "Profile", "ViewSpec", "auto_view_spec", "format_topic", "make_profile",
           "parse_view_spec"]

PROFILES: Final = ("full", "dynamo", "llm-d")
LLMD_TOPIC: Final = "kv@node:{node}@{model}"
FULL_ATTENTION: Final = "full_attention"


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    tails: bool  # publish partial tails (and their Mamba snapshots)
    attention_only: bool  # drop every event of a group that is not full attention
    engine_blocks: bool  # list a multi-block chunk as its engine blocks, block_size per block
    positional: bool  # events as arrays (pre vLLM #42892) instead of maps
    ownership: str | None  # value of the `ownership` field, None: field absent
    topic: str  # topic template ({node}, {model})

    def allows(self, event: KVEvent, tail: bool) -> bool:
        """Whether this profile publishes `event` (a tail's event when `tail`)."""
        if tail and not self.tails:
            return False
        if self.attention_only and isinstance(event, BlockStored):
            return event.kv_cache_spec_kind in (None, FULL_ATTENTION)
        return True


def make_profile(name: str = "full", *, tails: bool | None = None,
                 ownership: str | None = None, topic: str | None = None) -> Profile:
    """The rules of profile `name`; `tails`/`ownership`/`topic` override its defaults.

    ValueError for an unknown profile, or an ownership value with ``dynamo`` (its indexer
    drops every event carrying one: the setting would silently blank the router's view).
    """
    if name not in PROFILES:
        raise ValueError(f"unknown events profile {name!r} (known: {', '.join(PROFILES)})")
    ownership = ownership or None
    if name == "dynamo" and ownership is not None:
        raise ValueError("events_ownership cannot be used with the dynamo profile: Dynamo "
                         "1.6.1 drops every event that carries an ownership value")
    return Profile(
        name=name,
        tails=(name != "dynamo") if tails is None else tails,
        attention_only=name == "dynamo",
        engine_blocks=name == "dynamo",
        positional=name == "llm-d",
        ownership=ownership,
        topic=(LLMD_TOPIC if name == "llm-d" else "") if topic is None else topic,
    )


def format_topic(template: str, *, node: str = "", model: str = "") -> str:
    """`template` with {node} (default: this host's name) and {model} filled in.

    ValueError when the template needs a model and none is given: llm-d hashes the topic's
    model name into every block key, so a wrong or empty one matches nothing.
    """
    if "{model}" in template and not model:
        raise ValueError(f"events topic {template!r} needs events_model (the model name the "
                         "router hashes requests with)")
    try:
        return template.format(node=node or socket.gethostname(), model=model)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"events topic {template!r}: only {{node}} and {{model}} may be "
                         f"used ({exc})") from None


@dataclass(frozen=True, slots=True)
class ViewSpec:
    """One per-engine view: `rank=R,events=EP[,replay=EP][,engine=I][,namespace=NS][,topic=T]`."""

    rank: int
    endpoint: str
    replay: str | None = None
    engine: int | None = None  # index into --engine-events whose GPU batches are merged in
    namespace: str | None = None  # only events of this namespace (default: all)
    topic: str = ""


def auto_view_spec(template: str, rank: int, index: int = 0) -> ViewSpec:
    """The `index`-th view opened from `engine_views_auto`, for an engine of DP rank `rank`.

    `{rank}` and `{index}` are filled in; ValueError if the result is not a view spec."""
    if "rank=" in template.replace("{rank}", ""):
        raise ValueError(f"engine_views_auto {template!r}: the rank comes from the engine")
    filled = template.replace("{rank}", str(rank)).replace("{index}", str(index))
    return parse_view_spec(f"rank={rank},{filled}")


def parse_view_spec(spec: str) -> ViewSpec:
    """Parse a view spec; ValueError naming the part that is wrong."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("rank", "events", "replay", "engine", "namespace", "topic"):
            raise ValueError(f"engine view {spec!r}: {part!r} is not rank=, events=, replay=, "
                             "engine=, namespace= or topic=")
        fields[key] = value.strip()
    if "rank" not in fields or "events" not in fields:
        raise ValueError(f"engine view {spec!r} needs rank= and events=")
    try:
        rank = int(fields["rank"])
        engine = int(fields["engine"]) if fields.get("engine") else None
    except ValueError:
        raise ValueError(f"engine view {spec!r}: rank and engine must be integers") from None
    if rank < 0 or (engine is not None and engine < 0):
        raise ValueError(f"engine view {spec!r}: rank and engine must be >= 0")
    return ViewSpec(rank=rank, endpoint=fields["events"], replay=fields.get("replay") or None,
                    engine=engine, namespace=fields.get("namespace") or None,
                    topic=fields.get("topic", ""))
