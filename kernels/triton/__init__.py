"""Triton kernels for the GPU path, each beside its pure-torch twin.

The engine dispatches to them only for CUDA tensors (tokenyard.models.fused and
tokenyard.models.attention); on a CPU it keeps the C++ kernels or the torch twins. Tests run
every kernel under ``TRITON_INTERPRET=1`` on the CPU against its twin
(tests/unit/test_triton_kernels.py); scripts/gpu_check.sh runs them on a GPU.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Triton is installed (whether a GPU is present is the caller's question)."""
    return importlib.util.find_spec("triton") is not None
