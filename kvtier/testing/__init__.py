"""Test support: random-weight Llama models built locally, and vLLM engine helpers."""
