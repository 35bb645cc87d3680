"""A PEFT-format LoRA adapter read from its folder and checked against the base model.

A folder holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` (or `adapter_model.bin`) with one pair of tensors per adapted
projection, named as PEFT saves them:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in_features]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out_features, r]

The adapted projection computes W x + scaling * B A x, where scaling is lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). The scaling is folded into B here, once.

Everything wrong with a folder raises InvalidAdapter with a message that names the file,
the key or the setting at fault; a rank beyond the engine's limit raises AdapterLimit.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenyard.models.config import ModelConfig
from tokenyard.models.errors import AdapterLimit, InvalidAdapter

__all__ = ["AdapterLimit", "InvalidAdapter", "LoRAAdapter", "load_adapter"]

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# The projections an adapter may target, by their HF names: (our fused layer, its part).
# q/k/v are one fused qkv_proj in this engine, gate/up one gate_up_proj.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}

_KEY = re.compile(
    r"layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)\.lora_(?P<ab>[AB])(?:\.\w+)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host: per (layer, HF module name), A [r, in] and the
    scaled B [out, r]."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter in folder `path` for a base model of `config`."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidAdapter(f"adapter {name!r}: {path} is not a folder")
    settings = _read_config(name, folder)
    rank = settings.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise InvalidAdapter(f"adapter {name!r}: {CONFIG_FILE} needs a positive integer 'r'")
    if rank > max_rank:
        raise AdapterLimit(
            "max_lora_rank",
            f"adapter {name!r} has rank {rank}, beyond max_lora_rank {max_rank}",
        )
    _check_settings(name, settings)
    alpha = float(settings.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_weights(name, folder)
    weights = _pair_up(name, tensors, rank, scaling, config)
    targets = _config_targets(name, settings)
    found = {module for _, module in weights}
    if targets is not None and not found <= targets:
        raise InvalidAdapter(
            f"adapter {name!r}: weights for {sorted(found - targets)} not in target_modules"
        )
    return LoRAAdapter(name, str(folder), rank, weights)


def _read_config(name: str, folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not file.is_file():
        raise InvalidAdapter(f"adapter {name!r}: {CONFIG_FILE} missing in {folder}")
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidAdapter(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(settings, dict):
        raise InvalidAdapter(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    return settings


def _check_settings(name: str, settings: dict) -> None:
    """Refuse the PEFT options this engine does not compute, rather than ignore them."""
    peft_type = settings.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InvalidAdapter(f"adapter {name!r}: peft_type {peft_type!r}; only LORA is served")
    if settings.get("bias", "none") != "none":
        raise InvalidAdapter(f"adapter {name!r}: bias {settings['bias']!r}; only 'none' is served")
    for key in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern"):
        if settings.get(key):
            raise InvalidAdapter(f"adapter {name!r}: {key} is not supported")


def _config_targets(name: str, settings: dict) -> set[str] | None:
    """target_modules as a set of names we know (None: a regex or 'all-linear', checked by
    the weights' own keys instead)."""
    targets = settings.get("target_modules")
    if targets is None or isinstance(targets, str):
        return None
    unknown = sorted(set(targets) - TARGETS.keys())
    if unknown:
        raise InvalidAdapter(
            f"adapter {name!r}: unknown target module(s) {unknown}; supported: {sorted(TARGETS)}"
        )
    return set(targets)


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = folder / file_name
        if not file.is_file():
            continue
        try:
            if file_name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file: say which
            raise InvalidAdapter(f"adapter {name!r}: cannot read {file_name} ({e})") from e
        if not isinstance(tensors, dict):
            raise InvalidAdapter(f"adapter {name!r}: {file_name} holds no tensor dict")
        return tensors
    raise InvalidAdapter(f"adapter {name!r}: none of {list(WEIGHT_FILES)} in {folder}")


def _pair_up(
    name: str,
    tensors: dict[str, torch.Tensor],
    rank: int,
    scaling: float,
    config: ModelConfig,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The tensors as (A, scaled B) per (layer, module), each checked against the base."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m["module"] not in TARGETS:
            raise InvalidAdapter(
                f"adapter {name!r}: tensor {key!r} adapts no supported projection "
                f"(supported: {sorted(TARGETS)})"
            )
        layer = int(m["layer"])
        if layer >= config.num_hidden_layers:
            raise InvalidAdapter(
                f"adapter {name!r}: {key!r} names layer {layer}; the base model has "
                f"{config.num_hidden_layers}"
            )
        halves.setdefault((layer, m["module"]), {})[m["ab"]] = tensor
    if not halves:
        raise InvalidAdapter(f"adapter {name!r}: the weights file holds no LoRA tensors")
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise InvalidAdapter(f"adapter {name!r}: layer {layer} {module} has no {missing}")
        a, b = ab["A"].float(), ab["B"].float()
        in_size, out_size = module_shape(config, module)
        if a.shape != (rank, in_size) or b.shape != (out_size, rank):
            raise InvalidAdapter(
                f"adapter {name!r}: layer {layer} {module}: lora_A {tuple(a.shape)} and "
                f"lora_B {tuple(b.shape)}; the base model with r={rank} needs "
                f"{(rank, in_size)} and {(out_size, rank)}"
            )
        weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
    return weights


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection of the base model."""
    hidden, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]
