"""Shared test helpers: small real artifacts the tests build themselves (nothing from a hub)."""

import json
from pathlib import Path

from rl.data.tokenizer import BYTE_SPECIALS, ENDOFTEXT, IM_END

CORPUS = [
    "ls -la /tmp && cat notes.txt | sort | uniq -c",
    "def reverse(s):\n    return s[::-1]\n",
    'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n',
    "echo 'hello world' > out.txt; wc -l out.txt",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語",
    "<tool_response>\nexit code 0\n</tool_response>",
]


def build_hf_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE with Qwen-style ChatML specials; write tokenizer.json and
    tokenizer_config.json into `path` (an HF tokenizer directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BYTE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": IM_END,
                "pad_token": ENDOFTEXT,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
            }
        )
    )
    return path
