"""`kvoffload events tail`: print a KV-event stream (vLLM's or ours), one line per event.

`--json` prints exactly one JSON object per event: `seq`, `ts`, `dp_rank`, `type`, then the
event's fields by their vLLM names (hashes as JSON ints when ints on the wire, lowercase hex
strings when bytes). Gap and reset notices go to stderr so stdout stays machine-readable.

Lookup events (our own schema, `--lookup-events` endpoint) are recognised by decoding: a KV
batch is a msgpack array, a lookup batch a map. Their JSON lines are `seq`, `ts`,
`schema_version`, `type` ("LookupEvent"), then the event's fields. `--lookup` accepts only
lookup batches (anything else is skipped as malformed).

The command line (``kvoffload/cli/events.py``) parses and calls ``run_tail``. A mistyped
endpoint is one line (exit 2), and a stream that has sent nothing after a moment says once, on
stderr, what the tail is waiting for: a PUB that is not there is silent in ZMQ.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any, TextIO

import msgspec
import zmq

from .schema import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    LookupEvent,
    LookupEventBatch,
    MalformedPayload,
    decode_batch,
    decode_lookup_batch,
    to_json_dict,
)
from .subscriber import Gap, LookupEventSubscriber, Received, Reset, _Subscriber

__all__ = ["bad_endpoint", "format_event", "format_lookup_event", "run_tail",
           "tail"]

_json = msgspec.json.Encoder()
# Seconds without anything received before the one notice of what the tail waits for.
WAITING_NOTICE_S = 3.0


def bad_endpoint(flag: str, endpoint: str) -> str | None:
    """Why `endpoint` is not one a SUB or DEALER can connect to, or None (libzmq's own answer
    is an "Invalid argument" traceback)."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and rest and (scheme in ("ipc", "inproc") or (
            scheme == "tcp" and colon and host and port.isdigit() and 0 < int(port) < 65536)):
        return None
    return (f"{flag} {endpoint}: not a ZMQ endpoint; give tcp://HOST:PORT or ipc://PATH "
            "(the daemon's --events, --events-replay or --lookup-events address)")


def _waiting_line(endpoint: str, replay: str | None, lookup: bool) -> str:
    what = "lookup events" if lookup else "events"
    flag = "--lookup-events" if lookup else "--events (or --hub, an engine view)"
    more = f" (replay {replay})" if replay else ""
    return (f"# waiting for {what} on {endpoint}{more}: nothing received yet; is a daemon "
            f"publishing there ({flag} of kvoffload serve)? A PUB that is not there is "
            "silent: this keeps waiting")


def _short_hash(h: int | bytes | None) -> str:
    if isinstance(h, bytes):
        return h.hex()[-16:]  # the low 8 bytes are vLLM's int form: enough to eyeball
    return str(h)


def format_event(seq: int, batch: EventBatch, event: KVEvent) -> str:
    """One human-readable line; defaulted fields appear only when set."""
    head = f"seq={seq} ts={batch.ts:.6f} dp={batch.data_parallel_rank} {type(event).__name__}"
    parts = [head]
    if isinstance(event, BlockStored | BlockRemoved):
        hashes = ",".join(_short_hash(h) for h in event.block_hashes)
        parts.append(f"hashes=[{hashes}]")
    if isinstance(event, BlockStored):
        parts.append(f"parent={_short_hash(event.parent_block_hash)}")
        parts.append(f"tokens={len(event.token_ids)} block_size={event.block_size}")
    for name in event.__struct_fields__:
        if name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
            continue
        value = getattr(event, name)
        if value is not None:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _json_line(seq: int, batch: EventBatch, event: KVEvent) -> bytes:
    record: dict[str, Any] = {"seq": seq, "ts": batch.ts, "dp_rank": batch.data_parallel_rank}
    record.update(to_json_dict(event))  # "type" first, then the fields in vLLM's order
    return _json.encode(record)


def format_lookup_event(seq: int, batch: LookupEventBatch, event: LookupEvent) -> str:
    """One human-readable line of a lookup event: the outcome first, then the why."""
    tail = (f" tail={event.tail_hit_tokens}@{event.tail_boundary}"
            if event.tail_boundary is not None else "")
    line = (f"seq={seq} ts={batch.ts:.6f} LookupEvent v{batch.schema_version} "
            f"{event.outcome} req={event.request_id} ns={event.namespace} "
            f"prompt={event.prompt_tokens} local={event.local_tokens} hit={event.hit_tokens} "
            f"chunks={event.chunk_hit_tokens}{tail}")
    if event.miss_reason is not None:
        line += f" miss_reason={event.miss_reason}"
    return line


def _lookup_json_line(seq: int, batch: LookupEventBatch, event: LookupEvent) -> bytes:
    record: dict[str, Any] = {"seq": seq, "ts": batch.ts, "schema_version": batch.schema_version,
                              "type": type(event).__name__}
    record.update(msgspec.structs.asdict(event))
    return _json.encode(record)


def _decode_any(payload: bytes) -> EventBatch | LookupEventBatch:
    """A KV batch (msgpack array) or, failing that, a lookup batch (msgpack map)."""
    try:
        return decode_batch(payload)
    except MalformedPayload:
        return decode_lookup_batch(payload)


class _AnySubscriber(_Subscriber[EventBatch | LookupEventBatch]):
    _decode = staticmethod(_decode_any)


async def tail(
    endpoint: str,
    *,
    replay: str | None = None,
    from_seq: int | None = None,
    topic: str = "",
    as_json: bool = False,
    lookup: bool = False,
    count: int | None = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    waiting_notice_s: float = WAITING_NOTICE_S,
) -> int:
    """Print events until `count` events were printed (then return 0) or forever.

    If nothing arrives for `waiting_notice_s`, one line on `err` says what it waits for."""
    if count is not None and count <= 0:
        return 0
    kind = LookupEventSubscriber if lookup else _AnySubscriber
    sub = kind(endpoint, replay, topic=topic, from_seq=from_seq, stream="tail")
    loop = asyncio.get_running_loop()
    notice = loop.call_later(waiting_notice_s, lambda: print(
        _waiting_line(endpoint, replay, lookup), file=err, flush=True))
    try:
        return await _print_items(sub, notice, as_json, count, out, err)
    finally:
        notice.cancel()


async def _print_items(sub: _Subscriber[Any], notice: asyncio.TimerHandle, as_json: bool,
                       count: int | None, out: TextIO, err: TextIO) -> int:
    printed = 0
    async with sub:
        async for item in sub:
            notice.cancel()  # something came: the stream is there
            if isinstance(item, Gap):
                print(f"# gap: seqs {item.start}..{item.end - 1} lost", file=err, flush=True)
                continue
            if isinstance(item, Reset):
                print(
                    f"# reset: publisher restarted (expected seq {item.expected}, got {item.seq})",
                    file=err,
                    flush=True,
                )
                continue
            assert isinstance(item, Received)
            lines = []
            batch = item.batch
            for event in batch.events:
                if isinstance(batch, LookupEventBatch):
                    assert isinstance(event, LookupEvent)
                    lines.append(_lookup_json_line(item.seq, batch, event).decode() if as_json
                                 else format_lookup_event(item.seq, batch, event))
                elif isinstance(event, LookupEvent):  # never inside a KV batch
                    continue
                elif as_json:
                    lines.append(_json_line(item.seq, batch, event).decode())
                else:
                    lines.append(format_event(item.seq, batch, event))
                printed += 1
                if count is not None and printed >= count:
                    break
            if lines:
                out.write("\n".join(lines) + "\n")
                out.flush()  # consumers read line by line (pipes, `| jq`)
            if count is not None and printed >= count:
                return 0
    return 0


def run_tail(args: argparse.Namespace) -> int:
    """Handler for `events tail` (returns the exit code): a bad endpoint is one line, exit 2;
    one ZMQ refuses at connect (a host name that does not resolve) one line, exit 1."""
    for flag, endpoint in (("--endpoint", args.endpoint), ("--replay", args.replay)):
        if endpoint is not None and (why := bad_endpoint(flag, endpoint)):
            print(f"kvoffload events tail: {why}", file=sys.stderr)
            return 2
    coro = tail(
        args.endpoint,
        replay=args.replay,
        from_seq=args.from_seq,
        topic=args.topic,
        as_json=args.json,
        lookup=args.lookup,
        count=args.count,
    )
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        return 130
    except zmq.ZMQError as exc:
        print(f"kvoffload events tail: cannot connect to --endpoint {args.endpoint}"
              f"{f' / --replay {args.replay}' if args.replay else ''}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`| head`): not an error; silence the flush at exit.
        with contextlib.suppress(OSError):
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115
        return 0
