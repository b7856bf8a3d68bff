"""The engine loop the vLLM tests drive lives in the package (benchmarks run it too)."""

from kvoffload.bench.vllm_engine import (  # noqa: F401
    BLOCK,
    PAGE,
    ROW,
    UNIT,
    MiniEngine,
    state_page,
    token_row,
)
