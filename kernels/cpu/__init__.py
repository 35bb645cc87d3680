"""CPU kernels in C++, built on first use with torch's extension loader and cached on disk.

`ops()` returns the built module, or None where it cannot be built (no compiler, no ninja)
or where TOKENYARD_CPU_KERNELS=0; callers then take the pure-torch twin, which the tests
compare these kernels against. The first build takes about 30 s on two cores, into
~/.cache/tokenyard/kernels (or $TOKENYARD_KERNELS_DIR); later processes load the object
directly, in milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get("TOKENYARD_CPU_KERNELS", "1") not in ("0", "false", "no", "")


def ops() -> ModuleType | None:
    """The kernels' module, or None: use the torch twins. Decided once per process."""
    try:
        return _state["ops"]  # the hot path: called several times per layer per step
    except KeyError:
        pass
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _build() if enabled() else None
        return _state["ops"]


_FUNCTIONS = [
    "write_kv",
    "decode_attention",
    "span_attention",
    "span_available",
    "gather_kv",
    "argmax_rows",
    "add_rms_norm",
    "rotary",
    "silu_and_mul",
    "int8_linear",
    "int4_linear",
    "linear_i16",
    "linear_i8",
    "i16_available",
    "i16_vnni",
    "linear_amx",
    "linear_amx_silu",
    "amx_available",
    "linear_bf16",
    "pairs_available",
    "decoder_layers",
]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


def ops_for(t: torch.Tensor) -> ModuleType | None:
    """The kernels for a tensor's device: the module on a CPU, None elsewhere."""
    return ops() if t.device.type == "cpu" else None


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the kernels are built with -march=native, so a
    cache shared between machines (a container image) must not hand one CPU another's build."""
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.machine()
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


def _name(source: str) -> str:
    """One name per (source, flags, CPU, torch): a built object is never stale, only absent."""
    import torch

    key = "\0".join([source, *_CFLAGS, _cpu_tag(), torch.__version__])
    return "tokenyard_cpu_kernels_" + hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def _cache_dir(name: str) -> Path:
    root = (
        os.environ.get("TOKENYARD_KERNELS_DIR") or Path.home() / ".cache" / "tokenyard" / "kernels"
    )
    return Path(root) / name


def _build() -> ModuleType | None:
    source = _SOURCE.read_text()
    name = _name(source)
    build_dir = _cache_dir(name)
    try:
        built = build_dir / f"{name}.so"
        if built.exists():
            # Load the object directly: torch's loader would take its build lock and run ninja
            # in every process, and a process killed holding that lock blocks all later ones.
            import torch  # noqa: F401  (the object links against libtorch)

            loader = importlib.machinery.ExtensionFileLoader(name, str(built))
            spec = importlib.util.spec_from_file_location(name, built, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module
        from torch.utils.cpp_extension import load_inline

        build_dir.mkdir(parents=True, exist_ok=True)
        log.info("building the CPU kernels in %s (about 30 s, once)", build_dir)
        return load_inline(
            name=name,
            cpp_sources=[source],
            functions=_FUNCTIONS,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a sandbox without a writable cache
        log.warning(
            "CPU kernels unavailable, using the torch path: %s",
            str(exc).splitlines()[0] if str(exc) else exc,
        )
        return None
