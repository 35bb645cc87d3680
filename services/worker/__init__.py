"""What prefill and decode workers share: one WorkerBase (the engine thread) and its named
collaborators: streams (streams.py), presence (presence.py), hand-offs (handoff.py).

`python -m tokenyard.services.prefill`, `python -m tokenyard.services.decode`, or either with
``TOKENYARD_WORKER_ROLE=both`` for one worker that runs whole requests (aggregated mode).
"""
