"""Serving: the OpenAI-compatible HTTP server over the engine (`server.py`, `python -m labkit
serve`), a client for it (`client.py`), seeded request workloads (`workload.py`) and the
latencies a user feels (`metrics.py`)."""
