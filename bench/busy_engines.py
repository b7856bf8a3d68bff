"""Other engines busy on the machine while the whole-step bench measures (``bench/whole_step.py``).

``busy_engines(n, ...)`` starts ``n`` OS processes (``python -m kvoffload.bench.busy_engines``),
each hosting one pair of ``MiniEngine``s like the foreground's: ours (``KVOffloadConnector``) on
the SAME daemon in the same geometry, so the same namespace (the foreground's view takes in
their claims and commits: the real cost of sharing), and vLLM's ``CPUOffloadingSpec`` with its
own host blocks, as many as the foreground's. A pair serves its own chat (``ChatMix(seed + 1000
+ i)``, ``in_flight`` requests), steps its two engines alternately, then sleeps ``gpu_ms``: a
served engine's scheduler thread mostly waits for its GPU, it does not burn a core.

The parent talks to each child over pipes: the child's first line on its protocol pipe (its
real stdout; library prints go to its stderr log) says it has stepped once; closing its stdin
tells it to stop, and its last line is what it did (steps, requests, ours' stores). A child
whose parent died sees its stdin close and stops too: no orphans.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

READY_TIMEOUT_S = 300.0  # vLLM's import alone takes seconds a process, more on a busy machine
STOP_TIMEOUT_S = 60.0


class BusyEngines:
    """The running children; ``stop()`` ends them and returns each one's final report."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
        self.procs, self.logs = procs, logs
        self._lines: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self.reports: list[dict[str, Any] | None] = [None] * len(procs)
        self._stopped = False
        for i, proc in enumerate(procs):
            assert proc.stdout is not None
            threading.Thread(target=self._read, args=(i, proc.stdout), daemon=True,
                             name=f"busy-engine-{i}").start()

    def _read(self, i: int, pipe: IO[bytes]) -> None:
        for raw in pipe:
            with contextlib.suppress(ValueError):
                self._lines.put((i, json.loads(raw)))
        self._lines.put((i, None))  # end of file: the child exited

    def _fail(self, i: int, why: str) -> RuntimeError:
        tail = self.logs[i].read_text(errors="replace")[-3000:] if self.logs[i].exists() else ""
        return RuntimeError(f"busy engine {i}: {why}\n{tail}")

    def _wait(self, key: str, deadline: float) -> None:
        """Until every child has sent a line with ``key`` (or exited: an error)."""
        pending = set(range(len(self.procs)))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(min(pending), f"no {key!r} line in time")
            try:
                i, msg = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                if i in pending:
                    raise self._fail(i, f"exited (rc {self.procs[i].wait()}) before {key!r}")
                continue
            if "error" in msg:
                raise self._fail(i, msg["error"])
            if key in msg:
                if key == "report":
                    self.reports[i] = msg["report"]
                pending.discard(i)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        self._wait("ready", time.monotonic() + timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> list[dict[str, Any]]:
        """Close every child's stdin, collect its report, reap it."""
        if not self._stopped:
            self._stopped = True
            for proc in self.procs:
                assert proc.stdin is not None
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                self._wait("report", time.monotonic() + timeout)
            finally:
                self.kill()
        return [r for r in self.reports if r is not None]

    def kill(self) -> None:
        """Reap every child, killing any that has not exited within a few seconds."""
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def busy_engines(n: int, *, kind: str, control: str, seed: int = 0, in_flight: int = 24,
                 gpu_ms: float = 20.0, extra: dict[str, Any] | None = None
                 ) -> Iterator[BusyEngines]:
    """``n`` background engine pairs, every one stepped at least once before this yields;
    all of them stopped and reaped on exit, also on error."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvo-busy-") as tmp:
        logs = [Path(tmp) / f"busy-{i}.log" for i in range(n)]
        busy: BusyEngines | None = None
        try:
            for i, log_path in enumerate(logs):
                config = {"index": i, "kind": kind, "control": control, "seed": seed + 1000 + i,
                          "in_flight": in_flight, "gpu_ms": gpu_ms, "extra": extra or {}}
                with open(log_path, "wb") as log:  # the child holds its own descriptor
                    procs.append(subprocess.Popen(
                        [sys.executable, "-m", "kvoffload.bench.busy_engines", json.dumps(config)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                        env={"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_TARGET_DEVICE": "cpu",
                             **os.environ}))
            busy = BusyEngines(procs, logs)
            busy.wait_ready()
            yield busy
        finally:
            if busy is not None:
                busy.kill()
            else:
                for proc in procs:
                    proc.kill()
                    proc.wait()


# ------------------------------------------------------------------ the child


def _pair(config: dict[str, Any], proto: IO[str], stop: threading.Event) -> None:
    from kvoffload.bench.chat_driver import ChatMix, Inflight
    from kvoffload.bench.step_engines import engines

    ours, theirs = engines(config["kind"], config["control"], config["extra"])
    try:
        drivers = [Inflight(ours, ChatMix(config["seed"]), config["in_flight"], verify=False),
                   Inflight(theirs, ChatMix(config["seed"]), config["in_flight"], verify=False)]
        pause, steps = config["gpu_ms"] / 1000, 0
        while not stop.is_set():
            for d in drivers if steps % 2 else drivers[::-1]:
                d.step()
            steps += 1
            if steps == 1:
                proto.write(json.dumps({"ready": os.getpid()}) + "\n")
            stop.wait(pause)  # the model's step on the GPU
        manager = ours.connector.scheduler.manager.counters
        report = {"index": config["index"], "pid": os.getpid(), "steps": steps,
                  "ours": {**drivers[0].result(),
                           "stores_offered": manager.get("stores_offered", 0),
                           "stores_committed": manager.get("stores_committed", 0)},
                  "vllm": drivers[1].result()}
        for d in drivers:
            report["ours" if d is drivers[0] else "vllm"]["scheduler_us_per_step"] = round(
                1e6 * d.engine.scheduler_seconds / max(1, d.engine.steps), 1)
    finally:
        ours.shutdown()
        theirs.shutdown()
    proto.write(json.dumps({"report": report}) + "\n")


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not the protocol pipe
    stop = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.buffer.read()  # returns at end of file: the parent closed it, or died
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        _pair(json.loads(argv[0]), proto, stop)
    except BaseException:
        proto.write(json.dumps({"error": traceback.format_exc()[-3000:]}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
