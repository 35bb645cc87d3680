"""CPU kernels in C++, built on first use with torch's extension loader and cached on disk.

`ops()` returns the built module, or None where it cannot be built (no compiler, no ninja)
or where TOKENYARD_CPU_KERNELS=0; callers then take the pure-torch twin, which the tests
compare these kernels against. The first build takes about a minute on two cores, into
~/.cache/tokenyard/kernels (or $TOKENYARD_KERNELS_DIR); later processes load the object
directly, in milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from tokenyard import platforms
from tokenyard.kernels.cpu import constants

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# The one translation unit the build compiles (kernels.cpp includes every family's header).
_MAIN = _HERE / "kernels.cpp"
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


def _sources() -> str:
    """Every C++ file the build reads, and the generated constants.h, as one text: the key of
    the build's content-hashed name."""
    files = sorted(_HERE.glob("*.h")) + [_MAIN]
    return "\0".join([*(f.name + "\0" + f.read_text() for f in files), constants.header()])


def _name(sources: str) -> str:
    """One name per (sources, flags, CPU, torch): a built object is never stale, only absent.
    The kernels are built with -march=native, so a cache shared between machines (a container
    image) must not hand one CPU another's build: hence the CPU's flags in the key."""
    import torch

    key = "\0".join([sources, *_CFLAGS, platforms.cpu().tag(), torch.__version__])
    return "tokenyard_cpu_kernels_" + hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def _cache_dir(name: str) -> Path:
    root = (
        os.environ.get("TOKENYARD_KERNELS_DIR") or Path.home() / ".cache" / "tokenyard" / "kernels"
    )
    return Path(root) / name


def _build() -> ModuleType | None:
    name = _name(_sources())
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
        (build_dir / "constants.h").write_text(constants.header())
        log.info("building the CPU kernels in %s (about a minute, once)", build_dir)
        return load_inline(
            name=name,
            cpp_sources=[_MAIN.read_text()],
            functions=_FUNCTIONS,
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(_HERE), str(build_dir)],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a sandbox without a writable cache
        log.warning(
            "CPU kernels unavailable, using the torch path: %s",
            str(exc).splitlines()[0] if str(exc) else exc,
        )
        return None
