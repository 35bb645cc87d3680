"""The KV-cache service and the gateway handle bytes, text and tokens: they must run without
torch, whose import alone would cost each about 200 MiB of resident memory."""

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


def test_the_gateway_loads_its_tokenizer_without_torch():
    code = (
        "import sys, tokenyard.services.gateway.__main__\n"
        "from tokenyard.models.loader import load_tokenizer, model_id_of\n"
        "load_tokenizer(None), model_id_of(None)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
