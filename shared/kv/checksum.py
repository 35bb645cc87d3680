"""CRC-32 of KV payloads (the zlib polynomial: either end may use either library).

ISA-L's crc32 gives the same values as ``zlib.crc32`` about ten times faster; at KV
transfer rates that is the difference between the checksum costing more than the copy
and a small fraction of it, so isal is a dependency, not an optional speed-up.
"""

from __future__ import annotations

from isal.isal_zlib import crc32

__all__ = ["crc32"]
