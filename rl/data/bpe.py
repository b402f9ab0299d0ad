"""A small byte-level BPE tokenizer with the chat tokens simloop renders (Qwen3's), trained
locally with the `tokenizers` library: what a tiny agent needs to read a real harness's prompt
(Claude Code's system prompt and tool schemas are ~49,000 characters: ~49,000 tokens for the
byte tokenizer, ~4x fewer with a few thousand merges).

    path = train_bpe(texts, "runs/bpe", vocab_size=4096)
    tok = HFTokenizer(path)            # rl.data.tokenizer; TokenizerConfig(kind="hf", path=...)

The directory holds `tokenizer.json` and `tokenizer_config.json` (eos `<|im_end|>`, pad
`<|endoftext|>`), as an HF model directory carries them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from rl.data.tokenizer import ENDOFTEXT, IM_END, IM_START

SPECIAL = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
"""Special tokens, in id order after the merges: Qwen3's chat and tool-call markers."""


def train_bpe(texts: Iterable[str], out_dir: str | os.PathLike, *, vocab_size: int = 4096) -> Path:
    """Train a byte-level BPE of `vocab_size` ids (the 256 bytes, merges, `SPECIAL`) on
    `texts` and write it to `out_dir`; returns `out_dir`. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL) + 1:
        raise ValueError(
            f"vocab_size={vocab_size} is invalid: at least {256 + len(SPECIAL) + 1} (the 256 "
            "bytes, the special tokens and one merge)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": IM_END, "pad_token": ENDOFTEXT, "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
