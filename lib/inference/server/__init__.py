"""The builtin inference server, a program of its own: engine, decode step, vLLM's wire format and its routes."""
