"""kvoffload.connector.vllm."""
