"""Decode worker: `python -m tokenyard.services.decode` (code in tokenyard.services.worker)."""
