"""Tokenizers: the `Tokenizer` protocol, the built-in byte tokenizer, and HF `tokenizer.json`.

The byte tokenizer (ids 0-255 are bytes, then five specials) needs no files and is what tiny
CPU models use. `HFTokenizer` loads a local HF tokenizer directory (never a hub).
`load_tokenizer(TokenizerConfig)` picks one from config.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from rl import validate

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK = "<think>"
END_THINK = "</think>"
BYTE_SPECIALS = (ENDOFTEXT, IM_START, IM_END, THINK, END_THINK)


@runtime_checkable
class Tokenizer(Protocol):
    """What simloop needs of a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int:
        """End of turn for chat models (`<|im_end|>`)."""
        ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special-token strings inside it become their special ids."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Ids of `text` as plain text: special-token strings inside it are spelled with
        ordinary tokens, never their special ids (message content, which must not forge
        role markers). Equals `encode` on text without special-token strings."""
        ...

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str: ...

    def token_id(self, token: str) -> int:
        """Id of one special (or whole-token) string; KeyError if there is none."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`,
    `</think>` as 256-260. Any text round-trips exactly."""

    def __init__(self) -> None:
        self._special_ids = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)}
        self._special_tokens = {i: tok for tok, i in self._special_ids.items()}
        self._split = re.compile("(" + "|".join(re.escape(t) for t in BYTE_SPECIALS) + ")")

    @property
    def vocab_size(self) -> int:
        return 256 + len(BYTE_SPECIALS)

    @property
    def eos_id(self) -> int:
        return self._special_ids[IM_END]

    @property
    def pad_id(self) -> int:
        return self._special_ids[ENDOFTEXT]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            if i in self._special_tokens:
                if not skip_special:
                    out.append(self._special_tokens[i])
            elif not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is outside the byte vocabulary [0, {self.vocab_size})"
                )
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_id(self, token: str) -> int:
        if token in self._special_ids:
            return self._special_ids[token]
        raw = token.encode("utf-8")
        if len(raw) == 1:
            return raw[0]
        raise KeyError(f"{token!r} is not a single token of the byte tokenizer")


class HFTokenizer:
    """A local HF tokenizer directory: `tokenizer.json` (+ `tokenizer_config.json` for the
    eos/pad tokens). Loaded with the `tokenizers` library; no transformers at run time."""

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer as _RustTokenizer

        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"{file} not found: HFTokenizer needs a tokenizer.json")
        self._tok = _RustTokenizer.from_file(str(file))
        self._text_tok: _RustTokenizer | None = None
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        self._eos = self._resolve(config.get("eos_token"), (IM_END, ENDOFTEXT), "eos_token")
        self._pad = self._resolve(config.get("pad_token"), (ENDOFTEXT, IM_END), "pad_token")
        self._special = {
            t.content for t in self._tok.get_added_tokens_decoder().values() if t.special
        }

    def _resolve(self, configured, fallbacks: tuple[str, ...], what: str) -> int:
        if isinstance(configured, dict):  # {"content": "<|im_end|>", ...}
            configured = configured.get("content")
        candidates = ([configured] if configured else []) + list(fallbacks)
        for token in candidates:
            i = self._tok.token_to_id(token)
            if i is not None:
                return i
        raise ValueError(f"tokenizer has no {what}: tried {candidates}")

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        # A second instance that splits special tokens like text: the flag is per instance,
        # so flipping it on the shared one would race with concurrent `encode` calls.
        if self._text_tok is None:
            self._text_tok = type(self._tok).from_str(self._tok.to_str())
            self._text_tok.encode_special_tokens = True
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"{token!r} is not a token of this tokenizer")
        return i


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer a model uses."""

    kind: Literal["byte", "hf"] = "byte"
    """`byte`: built in, no files (tiny models); `hf`: a local directory with tokenizer.json."""
    path: str | None = None
    """Directory (or tokenizer.json file) for `kind: hf`."""

    def __post_init__(self) -> None:
        validate.one_of(self, "kind", ("byte", "hf"), allowed="'byte' or 'hf'")
        if self.kind == "hf" and not self.path:
            raise ValueError("TokenizerConfig.path is required when kind is 'hf'")


def hf_dir_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer an HF model directory (or a `tokenizer.json` path) carries, or simloop's
    byte tokenizer when there is none (the byte-level models `save_hf` writes)."""
    path = Path(path)
    found = (path / "tokenizer.json").exists() if path.is_dir() else path.exists()
    return HFTokenizer(path) if found else ByteTokenizer()


def load_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    return ByteTokenizer() if cfg.kind == "byte" else HFTokenizer(cfg.path)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids `a` and `b` share (prefix reuse, session rewinds). Lists
    are compared a slice at a time (C speed: a binary search over prefix equality), since
    the engine asks this for every slot whenever a request waits."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):
        if a[:n] == b[:n]:
            return n
        lo, hi = 0, n - 1  # a[:lo] == b[:lo], and a[:hi + 1] != b[:hi + 1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
