"""What prefill and decode workers share: the engine thread, heartbeats, cancel, KV events.

`python -m tokenyard.services.prefill`, `python -m tokenyard.services.decode`, or either with
``TOKENYARD_WORKER_ROLE=both`` for one worker that runs whole requests (aggregated mode).
"""
