"""Keep the libraries the benchmarks drive from writing on the bench's stderr (``--verbose``
keeps them).

vLLM 0.33 applies ``VLLM_LOGGING_LEVEL`` only when an engine configures logging, which the
suites never do, so its warnings reach Python's last-resort handler: the level is set on its
logger instead, here and in every process a suite starts (they inherit
``KVO_BENCH_QUIET`` and call ``quiet_loggers``). Mooncake's C++ side logs through glog at the
level its own ``MC_LOG_LEVEL`` sets (``GLOG_minloglevel`` is not honoured by its wheel, measured
with 0.3.13); ERROR is the highest it accepts, so the two metadata 404s every normal connect
logs at ERROR, and glog's "Logging before InitGoogleLogging" line, still show.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

# Not KVOFFLOAD_*: the daemons the suites start read every KVOFFLOAD_* variable as a setting.
QUIET_ENV = {"KVO_BENCH_QUIET": "1", "VLLM_LOGGING_LEVEL": "ERROR", "MC_LOG_LEVEL": "ERROR"}
# The plugin's start-up notes (one per engine, dozens per suite) and the notes of daemons a
# suite embeds in its own process (a tier connecting, recovering) are quieted as well.
QUIET_LOGGERS = ("vllm", "mooncake", "kvoffload.connector", "kvoffload.daemon")


def quiet_loggers() -> None:
    """In a process a suite started: quiet the loggers if the bench asked for it."""
    if os.environ.get("KVO_BENCH_QUIET") == "1":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


@contextlib.contextmanager
def quiet_libraries(verbose: bool) -> Iterator[None]:
    """Around the suites (before any imports vLLM or Mooncake); a no-op with ``verbose``. The
    environment and logger levels are restored afterwards (a caller in a test session keeps
    its own)."""
    if verbose:
        yield
        return
    saved_env = {key: os.environ.get(key) for key in QUIET_ENV}
    saved_levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    quiet_loggers()
    try:
        yield
    finally:
        for key, old in saved_env.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)
