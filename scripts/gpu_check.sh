#!/usr/bin/env bash
# The GPU check, in one go (a few minutes on a datacenter GPU):
#   1. every Triton kernel against its torch twin, compiled on CUDA (bf16 included);
#   2. the HF-equivalence suite with the engine on CUDA;
#   3. benchmarks/gpu.py: decode tok/s at batch 1 and 64 against the HBM bandwidth limit,
#      prefill TFLOP/s, written to benchmarks/results/gpu.json.
# Run from the repository root with the project's virtualenv set up (make setup) and
# triton installed (pip install triton, or the test extra).
set -euo pipefail
PY=${PY:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
"$PY" -c 'import triton' || { echo "triton is not installed" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

echo "== 1/3 Triton kernels vs their twins on CUDA"
TOKENYARD_TEST_DEVICE=cuda TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_triton_kernels.py

echo "== 2/3 HF equivalence with the engine on CUDA"
TOKENYARD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_engine_vs_hf.py

echo "== 3/3 decode and prefill figures"
"$PY" benchmarks/gpu.py --out benchmarks/results/gpu.json
