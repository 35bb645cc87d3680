#!/usr/bin/env bash
# The GPU check, in one go (a few minutes on a datacenter GPU):
#   1. every Triton kernel against its torch twin, compiled on CUDA (bf16 included);
#   2. the HF-equivalence suite with the engine on CUDA;
#   3. benchmarks/gpu.py: decode tok/s at batch 1 and 64 against the HBM bandwidth limit,
#      prefill TFLOP/s, written as JSON outside the repo (benchmarks/result_path.py);
#   4. with two GPUs or more, every parallel layout over NCCL: tensor and pipeline
#      parallelism, two ranks (and the planner's layouts that fit the GPUs) against one
#      rank's logprobs; expert parallelism (alone and beside tp=2 attention, across
#      rebalances) against HF; KV hand-offs between tp=1 and tp=2 engines, and between two
#      tp=2 workers through the stack (skipped, and said so, on a single GPU; each of these
#      files also skips its multi-rank tests itself when fewer than 2 GPUs are visible).
# Run from the repository root with the project's virtualenv set up (make setup) and
# triton installed (pip install triton, or the test extra).
set -euo pipefail
PY=${PY:-.venv/bin/python}
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "no CUDA GPU visible")'
"$PY" -c 'import triton' || { echo "triton is not installed" >&2; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true

echo "== 1/4 Triton kernels vs their twins on CUDA"
TOKENYARD_TEST_DEVICE=cuda TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
  tests/unit/test_triton_kernels.py

echo "== 2/4 HF equivalence with the engine on CUDA"
TOKENYARD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider tests/integration/test_engine_vs_hf.py

echo "== 3/4 decode and prefill figures"
"$PY" benchmarks/gpu.py

GPUS=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "$GPUS" -ge 2 ]; then
  echo "== 4/4 parallel layouts: tensor, pipeline and expert parallelism, TP hand-offs; NCCL"
  TOKENYARD_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/integration/test_tensor_parallel.py tests/integration/test_pipeline_parallel.py \
    tests/integration/test_expert_parallel.py tests/integration/test_tensor_parallel_handoff.py \
    tests/integration/test_tensor_parallel_handoff_stack.py
else
  echo "== 4/4 parallel layouts skipped: $GPUS GPU visible, 2 ranks need 2"
fi
