"""Rebuild a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores as metadata.

Matches what Hugging Face transformers builds from the same file, so token ids agree:
byte-level BPE ("gpt2") with a pre-tokenizer split chosen by `tokenizer.ggml.pre`, and
SentencePiece-style BPE ("llama") with byte fallback. Control tokens (token_type 3) and
user-defined tokens (4) become added tokens, so "<|im_start|>" in text stays one id.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tokenyard.models.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4
_SPIECE_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with. Anything else
# ("smollm", "gpt2", "default", ...) uses the GPT-2 regex built into ByteLevel.
_PRE_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def build_backend(md: dict[str, Any], path: str) -> Backend:
    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path!r}: no tokenizer.ggml.tokens in the metadata")
    if kind == "gpt2":
        backend = _byte_level(md, tokens)
    elif kind == "llama":
        backend = _sentencepiece(md, tokens)
    else:
        raise ModelLoadError(
            f"{path!r}: unsupported tokenizer.ggml.model {kind!r} (supported: gpt2, llama)"
        )
    _add_special_tokens(
        backend, tokens, md.get("tokenizer.ggml.token_type") or [], byte_level=kind == "gpt2"
    )
    backend.post_processor = _gguf_processor(md, tokens, default_add_bos=kind == "llama")
    return backend


def _byte_level(md: dict[str, Any], tokens: list[str]) -> Backend:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # A token written in plain text (not the byte alphabet) is re-spelled byte by byte.
    vocab = {
        tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
        )
    )
    add_prefix_space = bool(md.get("tokenizer.ggml.add_space_prefix", False))
    split = _PRE_SPLITS.get(md.get("tokenizer.ggml.pre", ""))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(md: dict[str, Any], tokens: list[str]) -> Backend:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if md.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        merges = _merges_from_scores(vocab, md.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    add_prefix_space = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE,
        prepend_scheme="first" if add_prefix_space else "never",
        split=False,
    )
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two
    vocabulary pieces is a merge, ranked by the merged token's score (higher first)."""
    ranked: list[tuple[float, int, int, int, int, int, str, str]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                # ties: longer left piece first, then file order (as transformers does)
                key = (-scores[index], -len(left), -len(right), index, vocab[left], vocab[right])
                ranked.append((*key, left, right))
    ranked.sort(key=lambda r: r[:6])
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(
    backend: Backend, tokens: list[str], types: list[int], *, byte_level: bool
) -> None:
    spelled = set(_byte_alphabet().values())
    control, user = [], []
    for token, kind in zip(tokens, types, strict=False):
        # NOTE: in a byte-level vocabulary a "control" token outside the byte alphabet is a
        # llama.cpp mislabel; adding it would grow the vocabulary past the model's size.
        if kind == _CONTROL and (not byte_level or set(token) <= spelled):
            control.append(AddedToken(token, special=True, normalized=False))
        elif kind == _USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(control)
    backend.add_tokens(user)


def _gguf_processor(
    md: dict[str, Any], tokens: list[str], *, default_add_bos: bool
) -> processors.PostProcessor:
    def special(key: str, flag: str, default: bool) -> tuple[str, int] | None:
        index = md.get(f"tokenizer.ggml.{key}")
        wanted = bool(md.get(f"tokenizer.ggml.{flag}", default))
        return (
            (tokens[index], index)
            if wanted and index is not None and 0 <= index < len(tokens)
            else None
        )

    return special_tokens_processor(
        special("bos_token_id", "add_bos_token", default_add_bos),
        special("eos_token_id", "add_eos_token", False),
    )


def special_tokens_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.PostProcessor:
    """What encode(add_special_tokens=True) adds: BOS before and/or EOS after the text."""
    single = " ".join([*([bos[0]] if bos else []), "$A", *([eos[0]] if eos else [])])
    pair = single + " " + single.replace("$A", "$B:1")
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t]
    )


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
