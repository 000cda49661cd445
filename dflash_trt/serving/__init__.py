"""Serving: the OpenAI-compatible HTTP server and the Triton Inference Server model repository,
both driving the in-flight-batching runtime (conventions: ../shared/SERVING.md)."""
