"""The one definition of a KV block's identity.

A full block of ``block_size`` tokens is named by ``hash(parent_hash, token_ids)``, so two
sequences that share a prefix share the hashes of every full block in it. The engine's
prefix cache, the router's global block index and the KV-cache service all call
:func:`block_hash` / :func:`prefix_block_hashes`; a peer that speaks another
``HASH_SPEC_VERSION`` must be refused, never silently trusted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# NOTE: bump this whenever the byte layout below changes; it travels in every KV layout
# descriptor and every KV event so mixed fleets refuse each other instead of mismatching.
HASH_SPEC_VERSION = "ty-blake2b64-v1"

# The parent of a sequence's first block.
ROOT_HASH = 0

_MASK64 = (1 << 64) - 1


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Content hash of one full block: 64 bits of BLAKE2b over (parent, int32 token ids)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash & _MASK64).to_bytes(8, "little"))
    h.update(array("i", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def salted_root(salt: str) -> int:
    """The parent of a sequence's first block: ROOT_HASH without a salt, else one of the
    salt's own, so sequences with different salts (tenants) never share a cached block
    and cannot probe or poison each other's prefixes (vLLM's ``cache_salt``)."""
    if not salt:
        return ROOT_HASH
    h = hashlib.blake2b(salt.encode(), digest_size=8, person=b"ty-cache-salt")
    return int.from_bytes(h.digest(), "little")


def adapter_salt(salt: str, adapter: str) -> str:
    """The prefix-cache salt of a request run on LoRA `adapter` ('' = the base model): the
    same tokens under another adapter have other K/V, so they must name other blocks here,
    in the router's index and in the KV-cache service alike."""
    if not adapter:
        return salt
    return f"{salt}\x1flora:{adapter}"


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, root: int = ROOT_HASH
) -> list[int]:
    """Hashes of every *full* block of ``token_ids``, chained from ``root``."""
    hashes: list[int] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
