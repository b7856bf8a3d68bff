"""Tests of kvoffload.connector.vllm, driven by vLLM 0.33's own scheduler and worker code."""
