"""Serving: the OpenAI-compatible HTTP server over the engine (`server.py`, `python -m labkit
serve`: the API it speaks in `protocol.py`, the engine thread in `worker.py`, one request's
answers in `choices.py`), a client for it (`client.py`), seeded request workloads
(`workload.py`) and the latencies a user feels (`metrics.py`)."""
