"""Trajectory data: tokenizers (HF + built-in bytes), ChatML rendering with append-only
updates; later also the trajectory schema, importers and grain datasets."""

from rl.data.chat import ChatRenderer, Message, generation_prompt, message_text, render_text
from rl.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerConfig,
    load_tokenizer,
)

__all__ = [
    "ByteTokenizer",
    "ChatRenderer",
    "HFTokenizer",
    "Message",
    "Tokenizer",
    "TokenizerConfig",
    "generation_prompt",
    "load_tokenizer",
    "message_text",
    "render_text",
]
