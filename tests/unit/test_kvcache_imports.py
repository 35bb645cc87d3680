"""The KV-cache service stores bytes by hash: it must run without torch, whose import alone
would cost it about 200 MiB of resident memory."""

from __future__ import annotations

import subprocess
import sys


def test_the_kvcache_service_does_not_import_torch():
    code = "import sys, tokenyard.services.kvcache.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
