"""The KV-cache service stores bytes by hash: it must run without torch, whose import alone
would cost it about 200 MiB of resident memory."""

from __future__ import annotations

import subprocess
import sys


def test_the_kvcache_service_does_not_import_torch():
    # Importing the service and judging a layout (what every Put and Get does).
    code = (
        "import sys, tokenyard.services.kvcache.__main__\n"
        "from tokenyard.kv.layout import KVLayout\n"
        "from tokenyard.services.kvcache.handlers import refusal\n"
        "layout = KVLayout('m', 'bfloat16', 16, 2, 2, 64)\n"
        "assert refusal(layout) is None and layout.block_nbytes == 16 * 2 * 2 * 2 * 64 * 2\n"
        "assert refusal(KVLayout('m', 'int3', 16, 2, 2, 64)) is not None\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
