"""Keep the libraries the benchmarks drive from writing on the bench's stderr (``--verbose``
keeps them).

vLLM 0.33 applies ``VLLM_LOGGING_LEVEL`` only when an engine configures logging, which the
suites never do, so its warnings reach Python's last-resort handler: the level is set on its
logger instead, here and in every process a suite starts (they inherit
``KVO_BENCH_QUIET`` and call ``quiet_loggers``). Mooncake's C++ side logs with glog,
which reads ``GLOG_minloglevel`` when its library loads, and its own ``MC_LOG_LEVEL``.
"""

from __future__ import annotations

import logging
import os

# Not KVOFFLOAD_*: the daemons the suites start read every KVOFFLOAD_* variable as a setting.
QUIET_ENV = {"KVO_BENCH_QUIET": "1", "VLLM_LOGGING_LEVEL": "ERROR",
             "GLOG_minloglevel": "2", "GLOG_logtostderr": "0", "MC_LOG_LEVEL": "ERROR"}
# The plugin's own start-up notes (one per engine, dozens per suite) are quieted as well.
QUIET_LOGGERS = ("vllm", "mooncake", "kvoffload.connector")


def quiet_loggers() -> None:
    """In a process a suite started: quiet the loggers if the bench asked for it."""
    if os.environ.get("KVO_BENCH_QUIET") == "1":
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def quiet_libraries(verbose: bool) -> None:
    """Before any suite imports vLLM or Mooncake; a no-op with ``verbose``."""
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    quiet_loggers()
