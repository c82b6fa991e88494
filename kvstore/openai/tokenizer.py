"""Tokenizers, with what a server needs beside them: special tokens, EOS ids and the chat template.

The router must hash a prompt exactly as the replica will, and the worker
must turn sampled ids back into text and stop where the model says stop, so
both load the same :class:`Tokenizer`:

- :class:`ByteTokenizer` -- UTF-8 bytes as ids 0..255, for the built-in
  model; its chat template writes ChatML markers as plain text.
- :class:`HFTokenizer` -- a Hugging Face ``tokenizer.json`` through the
  ``tokenizers`` library. Given a model directory it also reads
  ``tokenizer_config.json`` (special tokens, ``chat_template``),
  ``chat_template.jinja`` (which wins over the config's, as in
  transformers) and ``generation_config.json`` (EOS ids).

Completions encode with ``add_special_tokens=True`` (the tokenizer's own
post-processor adds BOS where the model wants it) and chat prompts with
False (the template writes BOS itself), exactly as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvstore.errors import ConfigError
from kvstore.openai.chat_template import BYTE_MODEL_CHAT_TEMPLATE, ChatTemplate


class Tokenizer(Protocol):
    """What the router and workers need of a tokenizer. Implementations are thread-safe."""

    @property
    def vocab_size(self) -> int | None:
        """Ids are below this (None: unknown)."""
        ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The tokenizer's own EOS: ends a generation (no stop reason) unless ``ignore_eos``."""
        ...

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ... as the chat template sees them."""
        ...

    @property
    def chat_template(self) -> ChatTemplate | None: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (``convert_ids_to_tokens``: ``Ġhello``, not `` hello``)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ids >= 256 decode to ``?`` (not U+FFFD, which the detokenizer reads as a
    character still coming), so the toy model's larger vocabulary shows them all as ``?``. No special tokens, no
    EOS."""

    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self) -> None:
        self._template = ChatTemplate(BYTE_MODEL_CHAT_TEMPLATE)

    @property
    def special_tokens(self) -> dict[str, str]:
        return {}

    @property
    def chat_template(self) -> ChatTemplate:
        return self._template

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        data = bytes(t if 0 <= t < 256 else 0x3F for t in token_ids)
        return data.decode("utf-8", errors="replace")

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """A byte's token is that byte read as Latin-1 (one character per byte); ids >= 256 are ``?``."""
        return [chr(t) if 0 <= t < 256 else "?" for t in token_ids]


class HFTokenizer:
    """A Hugging Face tokenizer (``tokenizer.json``), and, from a model directory, its template and specials."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        path = Path(path)
        directory = path if path.is_dir() else path.parent
        file = directory / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"{path}: no tokenizer.json (give a model directory or a tokenizer.json file)")
        try:
            self._tok = _Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise ConfigError(f"cannot load tokenizer {file}: {exc}") from None
        config = read_json_object(directory / "tokenizer_config.json") if path.is_dir() else {}
        self._special = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
            if (text := _token_text(config.get(key))) is not None
        }
        self._template = _find_template(directory, config) if path.is_dir() else None
        self._eos = _eos_ids(self._special.get("eos_token"), self._tok)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def special_tokens(self) -> dict[str, str]:
        return dict(self._special)

    def special_token_ids(self) -> dict[str, int]:
        """The added tokens marked special (``<|im_start|>``, ``<|python_tag|>``, ...): text -> id."""
        added = self._tok.get_added_tokens_decoder()
        return {str(token.content): int(token_id) for token_id, token in added.items() if token.special}

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # encode_batch of one text, not encode: the same ids at the same cost, but the library releases the
        # GIL only around its batch call -- encode holds it, so a long prompt tokenised in a worker thread
        # (the router's relay) would stop the event loop for as long as it takes.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(t) or "" for t in token_ids]

    def json_text(self) -> str:
        """The tokenizer as ``tokenizer.json`` text (what llguidance builds its view of the vocabulary from)."""
        return str(self._tok.to_str())


BYTES = "bytes"
"""The name of the built-in model's byte tokenizer where a path is expected (``router.tokenizer``)."""


def load_tokenizer(path: str | None) -> Tokenizer:
    """A model directory's or a ``tokenizer.json``'s tokenizer; the byte tokenizer when ``path`` is empty or
    :data:`BYTES`."""
    if not path or path == BYTES:
        return ByteTokenizer()
    if not Path(path).exists():
        raise ConfigError(f"tokenizer {path}: no such file or directory")
    return HFTokenizer(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """A model directory's JSON file as a dict ({} when absent); ConfigError when unreadable or not an object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _find_template(directory: Path, config: dict[str, Any]) -> ChatTemplate | None:
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return ChatTemplate(jinja.read_text(encoding="utf-8"))
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: transformers picks "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return ChatTemplate(source) if isinstance(source, str) else None


def _eos_ids(eos_token: str | None, tok: Any) -> tuple[int, ...]:
    """The tokenizer's own EOS (its config's ``eos_token``), as vLLM takes it: the generation config's other EOS
    ids are the worker's to add, as stop token ids (``kvstore.workers.sampler.eos_split``)."""
    if eos_token is not None and (token_id := tok.token_to_id(eos_token)) is not None:
        return (int(token_id),)
    return ()
