"""Serving: the continuous-batching engine, its process, and the OpenAI-compatible HTTP server."""
