"""Tokenizers: the byte tokenizer round-trips anything; HF tokenizer.json loads locally."""

import json
import random

import pytest
from transformers import AutoTokenizer

from rl.data import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig, load_tokenizer
from rl.data.tokenizer import IM_END, IM_START, common_prefix_len
from tests.fakes import CORPUS, build_hf_tokenizer


def test_byte_tokenizer_round_trips_text_and_specials():
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 261
    text = f"{IM_START}user\nÜnïcödé ✓ 日本語 \x00\t{IM_END}\n"
    ids = tok.encode(text)
    assert ids[0] == tok.token_id(IM_START) == 257
    assert tok.eos_id == tok.token_id(IM_END) == 258 and tok.pad_id == 256
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "user\nÜnïcödé ✓ 日本語 \x00\t\n"


def test_byte_tokenizer_decodes_partial_utf8_with_replacement_and_rejects_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode(list("✓".encode())[:2]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tok.decode([261])
    with pytest.raises(KeyError):
        tok.token_id("ab")


def test_byte_tokenizer_round_trips_real_trajectory_text(swe_agent_trajectories):
    tok = ByteTokenizer()
    for file in sorted(swe_agent_trajectories.glob("*.traj"))[:6]:
        for step in json.loads(file.read_text())["trajectory"]:
            obs = step.get("observation") or ""
            assert tok.decode(tok.encode(obs)) == obs


def test_hf_tokenizer_matches_transformers_on_the_same_files(tmp_path):
    path = build_hf_tokenizer(tmp_path / "tok")
    ours = HFTokenizer(path)
    ref = AutoTokenizer.from_pretrained(path)
    assert ours.eos_id == ref.convert_tokens_to_ids(IM_END)
    assert ours.vocab_size == len(ref)
    for text in CORPUS + [f"{IM_START}assistant\nls{IM_END}\n"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
    assert ours.encode(IM_START) == [ours.token_id(IM_START)]


def test_hf_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
    path = build_hf_tokenizer(tmp_path / "tok")
    with pytest.raises(KeyError, match="not a token"):
        HFTokenizer(path).token_id("<|no_such_token|>")


def test_tokenizer_config_selects_and_validates(tmp_path):
    assert isinstance(load_tokenizer(TokenizerConfig()), ByteTokenizer)
    path = build_hf_tokenizer(tmp_path / "tok")
    assert isinstance(load_tokenizer(TokenizerConfig(kind="hf", path=str(path))), HFTokenizer)
    with pytest.raises(ValueError, match="path is required"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="'byte' or 'hf'"):
        TokenizerConfig(kind="sentencepiece")


def test_common_prefix_len_agrees_with_a_plain_scan():
    """The engine's slice-at-a-time search, against the obvious loop, on lists and tuples."""

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    for _ in range(3000):
        a = [rng.randrange(3) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(9))]
        for x, y in ((a, b), (b, a), (tuple(a), b)):
            assert common_prefix_len(x, y) == scan(x, y), (x, y)
