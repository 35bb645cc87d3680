"""The engine's tokenizer: `tokenizers` for the text <-> ids work, jinja2 for chat templates.

Built from a GGUF file's metadata (see gguf_tokenizer.py) or a Hugging Face folder
(tokenizer.json + tokenizer_config.json), never from the hub.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from tokenyard.models.chat_template import render_chat_template
from tokenyard.models.errors import ModelLoadError
from tokenyard.models.gguf_tokenizer import build_backend, special_tokens_processor

# End-of-turn tokens of common chat formats; generation stops on any that the vocabulary has.
_END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.chat_template = chat_template
        self._text_backend: Backend | None = None
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.eos_token_ids: set[int] = {
            i for i in (self.eos_token_id, *extra_eos_ids) if i is not None
        }
        special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.eos_token_ids |= {
            i for t in _END_OF_TURN if t in special and (i := self._id_of(t)) is not None
        }

    # -- construction ---------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any], path: str = "<gguf>") -> Tokenizer:
        backend = build_backend(md, path)
        tokens: list[str] = md["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            index = md.get(f"tokenizer.ggml.{key}")
            return tokens[index] if index is not None and 0 <= index < len(tokens) else None

        return cls(
            backend,
            bos_token=token("bos_token_id"),
            eos_token=token("eos_token_id"),
            unk_token=token("unknown_token_id"),
            pad_token=token("padding_token_id"),
            chat_template=md.get("tokenizer.chat_template"),
            extra_eos_ids=[i for i in [md.get("tokenizer.ggml.eot_token_id")] if i is not None],
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(f"{str(folder)!r} has no tokenizer.json")
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ModelLoadError(f"cannot read {str(folder / 'tokenizer.json')!r}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        _apply_add_special_flags(backend, config)
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=_hf_chat_template(folder, config),
            extra_eos_ids=_hf_eos_ids(folder),
        )

    # -- text <-> ids ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: encode_batch, not encode: the batch call releases the GIL while it works, so
        # a long prompt tokenized on a thread leaves the gateway's event loop free; same ids.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_as_text(self, text: str) -> list[int]:
        """Encode with special-token text ("<|im_start|>") as the plain characters it is."""
        if self._text_backend is None:
            # A copy that never parses special tokens: toggling the shared one is not thread-safe.
            self._text_backend = Backend.from_str(self.backend.to_str())
            self._text_backend.encode_special_tokens = True
        return self._text_backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any
    ) -> list[int]:
        """The chat template's prompt ids, where only the template makes role markers: a
        message that contains "<|im_start|>system" is that text, not a new turn.

        Each content is rendered as a random marker, the markers are cut out of the rendered
        text, and the template's pieces and the contents are encoded apart.
        """
        nonce = secrets.token_hex(8)
        marked = [{**m, "content": f"\ue000{nonce}{i}\ue001"} for i, m in enumerate(messages)]
        rendered = self.apply_chat_template(
            marked, add_generation_prompt=add_generation_prompt, **variables
        )
        pieces = re.split(f"\ue000{nonce}(\\d+)\ue001", rendered)
        ids: list[int] = []
        for n, piece in enumerate(pieces):
            if n % 2 == 0:  # the template's text
                ids += self.encode(piece, add_special_tokens=False) if piece else []
            else:  # message int(piece)'s content
                ids += self.encode_as_text(str(messages[int(piece)]["content"]))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, for logprobs (a partial UTF-8 sequence shows as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass a plain text prompt instead")
        variables = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
            **kwargs,
        }
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text, one completed piece at a time.

    Each step decodes a short window twice, with and without the newest tokens:

        ids:  ... prompt ... | t0 t1 t2 | t3
                  prefix_offset^        ^read_offset
        new text = decode(ids[prefix:]) minus decode(ids[prefix:read])

    The left context keeps SentencePiece's leading-space handling right; text ending in
    U+FFFD means a multi-byte character is still split across tokens, so we wait.
    """

    _CONTEXT = 5  # prompt tokens of left context, as vLLM uses

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids)
        self._prefix_offset = max(len(self._ids) - self._CONTEXT, 0)
        self._read_offset = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        return self._text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text they completed (possibly "")."""
        pieces = []
        for token_id in token_ids:
            self._ids.append(token_id)
            pieces.append(self._step(final=False))
        return self._emit("".join(pieces))

    def flush(self) -> str:
        """At the end of a sequence: release whatever is held back, even an incomplete character."""
        return self._emit(self._step(final=True))

    def _step(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        new_text = decode(self._ids[self._prefix_offset :], self._skip)
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(_REPLACEMENT_CHAR) and not final
        ):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def _emit(self, piece: str) -> str:
        self._text += piece
        return piece


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _apply_add_special_flags(backend: Backend, config: dict[str, Any]) -> None:
    """tokenizer_config.json's add_bos_token/add_eos_token override tokenizer.json's
    post-processor, as transformers does; so does a missing post-processor."""
    if (
        "add_bos_token" not in config
        and "add_eos_token" not in config
        and backend.post_processor is not None
    ):
        return

    def special(name: str, flag: str) -> tuple[str, int] | None:
        token = _token_content(config.get(name))
        index = backend.token_to_id(token) if token is not None and config.get(flag) else None
        return (token, index) if token is not None and index is not None else None

    backend.post_processor = special_tokens_processor(
        special("bos_token", "add_bos_token"), special("eos_token", "add_eos_token")
    )


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get(
        "chat_template"
    )
    if isinstance(
        template, list
    ):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _hf_eos_ids(folder: Path) -> list[int]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    return ids
