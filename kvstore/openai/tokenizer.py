"""Prompt tokenisation for the router.

The router must hash a prompt exactly as the replicas will, so it tokenises
with the replicas' tokenizer: a byte-level one by default (our workers' toy
model reads UTF-8 bytes), or a ``tokenizer.json`` through the ``tokenizers``
library for a real model fleet.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvstore.errors import ConfigError


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; ids >= 256 decode to U+FFFD."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t if 0 <= t < 256 else 0x3F for t in token_ids)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (no special tokens added)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception for bad files
            raise ConfigError(f"cannot load tokenizer {path}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids))


def load_tokenizer(path: str | None) -> Tokenizer:
    """The byte-level tokenizer when ``path`` is empty, else the tokenizer.json at ``path``."""
    if not path:
        return ByteTokenizer()
    if not Path(path).is_file():
        raise ConfigError(f"router.tokenizer: {path} is not a file")
    return HFTokenizer(path)
