"""The prefill-to-decode hand-off, as the engine offers it to a worker.

    prefill worker                                   decode worker
    add_request(rid, prompt, prefill_only=True)
    step() ... -> finish_reason "prefilled"
    export_sequence(rid) -> ExportedSequence  ---->  import_sequence(rid, prompt, output,
       (its blocks stay held)                            params) -> fresh block ids
                                                     ... KV bytes copied into them ...
    release(rid)  <---- pulled (or timed out) -----  commit_import(rid, kv_ok)
                                                     step() ... decodes on

With ``kv_ok=False`` (the transfer failed) the decode side recomputes the prompt itself, so a
lost transfer costs time, never the request.
"""

from __future__ import annotations

from typing import Protocol

from tokenyard.engine.outputs import ExportedSequence
from tokenyard.engine.sampling_params import SamplingParams

__all__ = ["ExportedSequence", "Handoff"]


class Handoff(Protocol):
    def export_sequence(self, request_id: str) -> ExportedSequence:
        """A finished prefill-only request's prompt, first token and blocks (still held)."""
        ...

    def release(self, request_id: str) -> None:
        """Free a held prefill's blocks (pulled, refused or timed out); a no-op otherwise."""
        ...

    def import_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
    ) -> list[int]:
        """Fresh blocks for a handed-off prompt's KV; the sequence waits for commit_import.

        Raises NoFreeBlocks when the pool is full, ValueError for a bad sequence."""
        ...

    def commit_import(self, request_id: str, kv_ok: bool) -> None:
        """Start decoding an imported sequence; kv_ok=False recomputes its prompt first."""
        ...
