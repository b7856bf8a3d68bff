"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime 1.6.1) as a test fixture.

The wheel lives in its own venv (.venv-dynamo, made by scripts/setup_dynamo.sh: its pydantic
pin clashes with vLLM's). `dynamo_python()` makes it on demand once and says why not when it
cannot. `DynamoIndexer` runs `python -m dynamo.indexer` and talks to its HTTP API:
`/register` (a worker's ZMQ stream, block size, DP rank, replay endpoint), `/dump` (the index
as stored events per worker and storage tier) and `/query` (a token prefix's matches).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import zmq
from kvoffload.events.publisher import END_SEQ, SEQ
from kvoffload.events.schema import BlockRemoved, BlockStored, decode_batch

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVOFFLOAD_DYNAMO_VENV", ROOT / ".venv-dynamo"))
_setup_error: list[str] = []


def dynamo_python() -> tuple[Path | None, str]:
    """(python of the Dynamo venv, "") or (None, why it is not there)."""
    py = VENV / "bin" / "python"
    if os.environ.get("KVOFFLOAD_SKIP_DYNAMO") == "1":
        return None, "KVOFFLOAD_SKIP_DYNAMO=1"
    if not py.exists() and not _setup_error:
        done = subprocess.run(["bash", str(ROOT / "scripts" / "setup_dynamo.sh")],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            _setup_error.append(f"scripts/setup_dynamo.sh failed: {done.stderr.strip()[-400:]}")
    if _setup_error:
        return None, _setup_error[0]
    ok = subprocess.run([str(py), "-m", "dynamo.indexer", "--help"], capture_output=True,
                        text=True, timeout=60)
    if ok.returncode != 0:
        return None, f"dynamo.indexer does not run: {ok.stderr.strip()[-400:]}"
    return py, ""


def free_port() -> int:
    # The indexer takes a fixed --port; a just-freed OS-picked port is the best we can do.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DynamoIndexer:
    def __init__(self, python: Path, workdir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "dynamo-indexer.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 - owned by the child process
        self.proc = subprocess.Popen(
            [str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"})
        deadline = time.monotonic() + 30
        while True:
            try:
                self.get("/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"dynamo.indexer did not start:\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            body = r.read().decode()
        return json.loads(body) if body else None

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def register(self, worker: int, endpoint: str, block_size: int, *, dp_rank: int = 0,
                 replay: str | None = None, model: str = "m") -> None:
        body: dict[str, Any] = {"instance_id": worker, "endpoint": endpoint,
                                "model_name": model, "block_size": block_size,
                                "dp_rank": dp_rank}
        if replay is not None:
            body["replay_endpoint"] = replay
        status, answer = self.post("/register", body)
        assert status == 201, (status, answer)

    def blocks(self) -> set[tuple[int, int, str, int]]:
        """(worker, dp_rank, storage tier, block hash) of every block in the index."""
        out: set[tuple[int, int, str, int]] = set()
        for model in (self.get("/dump") or {}).values():
            for e in model["events"]:
                stored = e["event"]["data"].get("stored")
                for b in (stored or {}).get("blocks", []):
                    out.add((e["worker_id"], e["event"]["dp_rank"], e["storage_tier"],
                             b["block_hash"]))
        return out

    def query(self, tokens: list[int], model: str = "m") -> dict[str, Any]:
        status, answer = self.post("/query", {"token_ids": tokens, "model_name": model})
        assert status == 200, (status, answer)
        return dict(answer)


TIERS = {"GPU": "device", "CPU": "host_pinned", "STORAGE": "disk"}


def replay_state(replay: str, timeout: float = 30.0) -> tuple[set[tuple[str, int]], int, int,
                                                               list[str | None]]:
    """Replay a stream from seq 0 and fold it: ({(tier, hash)}, events, batches, kinds seen).

    Only our own decoder reads this; it says what the stream told, which Dynamo's index must
    then equal.
    """
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(replay)
    state: set[tuple[str, int]] = set()
    events = batches = 0
    kinds: list[str | None] = []
    try:
        sock.send_multipart([b"", SEQ.pack(0)])
        deadline = time.monotonic() + timeout
        while True:
            if not sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)):
                raise TimeoutError("no replay end marker")
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                return state, events, batches, kinds
            batch = decode_batch(frames[3])
            batches += 1
            for ev in batch.events:
                events += 1
                if isinstance(ev, BlockStored):
                    kinds.append(ev.kv_cache_spec_kind)
                    state.update((TIERS[ev.medium or "GPU"], int(h)) for h in ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    state.difference_update((TIERS[ev.medium or "GPU"], int(h))
                                            for h in ev.block_hashes)
    finally:
        sock.close()
