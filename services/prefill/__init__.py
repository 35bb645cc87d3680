"""Prefill worker: `python -m tokenyard.services.prefill` (code in tokenyard.services.worker)."""
