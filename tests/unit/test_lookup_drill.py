"""`simloop lookup-drill`: a warm-up that trains served weights on finding a line by its
content, loss on the looked-up number only."""

from __future__ import annotations

import json
import random
import re

import pytest
from flax import nnx

from launch.cli import main
from launch.jobs.lookup_drill import _row_length, count_row, lookup_batch, lookup_row
from rl.data.tokenizer import ByteTokenizer
from rl.model import Qwen3, tiny
from rl.model.loading import ModelSource
from rl.model.params_io import read_model_config, save_params


def test_a_row_asks_for_the_number_of_one_listed_line():
    rng = random.Random(3)
    for _ in range(200):
        context, target = lookup_row(rng, 2, 6)
        lines = context.split("\n")
        listed = lines[1:-2]
        assert 2 <= len(listed) <= 6 and all(re.fullmatch(r"[a-z]+-\d\d", ln) for ln in listed)
        word = lines[-1].removesuffix("-")
        assert lines[-2] == f"$ lookup {word}"
        words = [ln.split("-")[0] for ln in listed]
        assert len(set(words)) == len(words)  # the word names exactly one line
        assert f"{word}-{target.strip()}" in listed and re.fullmatch(r"\d\d\n", target)


def test_a_count_row_asks_for_the_line_count_of_one_listed_file():
    rng = random.Random(5)
    seen = set()
    for _ in range(300):
        context, target = count_row(rng, 1, 9)
        *blocks, query = re.split(r"(?m)^(?=== |\$ )", context)
        assert query.startswith("$ count ") and query.endswith("\n") and blocks[0] == ""
        files = {}
        for block in blocks[1:]:
            head, *lines = block.rstrip("\n").split("\n")
            name = re.fullmatch(r"== (\S+) ==", head).group(1)
            assert name not in files and all(re.fullmatch(r"[a-z]+(-\d\d)?", ln) for ln in lines)
            files[name] = len(lines)
        assert 1 <= len(files) <= 3 and all(1 <= n <= 9 for n in files.values())
        asked = query.removeprefix("$ count ").strip()
        assert target == f"{files[asked]}\n"
        seen.add(len(files))
    assert seen == {1, 2, 3}


@pytest.mark.parametrize("task", ["lookup", "count", "both"])
def test_every_drill_fits_its_row_length(task):
    rng = random.Random(7)
    for _ in range(50):
        lookup_batch(rng, 16, _row_length(26, task), 26, 26, task)  # raises when a row spills


def test_the_loss_mask_covers_the_target_bytes_and_nothing_else():
    tokens, mask = lookup_batch(random.Random(0), 16, _row_length(6), 2, 6)
    tok = ByteTokenizer()
    for row, m in zip(tokens, mask, strict=True):
        picked = [int(row[i + 1]) for i in range(len(m)) if m[i]]
        text = tok.decode(picked)
        assert re.fullmatch(r"\d\d\n", text), text  # each marked position predicts the next
    tokens, mask = lookup_batch(random.Random(0), 16, _row_length(9, "count"), 1, 9, "count")
    for row, m in zip(tokens, mask, strict=True):
        text = tok.decode([int(row[i + 1]) for i in range(len(m)) if m[i]])
        assert re.fullmatch(r"[1-9]\n", text), text
        assert tok.decode([int(t) for t in row]).rstrip("\0").endswith(f"\n{text}")


def test_the_drill_trains_and_writes_weights_that_load(tmp_path, capsys):
    save_params(Qwen3(tiny(), rngs=nnx.Rngs(0)), tmp_path / "w")
    args = ["lookup-drill", str(tmp_path / "w"), "--out", str(tmp_path / "d")]
    assert main([*args, "--steps", "20", "--batch", "8", "--lr", "3e-3", "--eval-every", "10"]) == 0
    record = json.loads((tmp_path / "d" / "lookup_drill.json").read_text())
    assert [c["step"] for c in record["curve"]] == [0, 10, 20]
    # from ~ln(512) over the whole vocabulary to the digits' share of it: the loss must fall
    assert record["curve"][-1]["loss"] < record["curve"][0]["loss"] - 1.0, record["curve"]
    assert read_model_config(tmp_path / "d" / "weights" / "final") == read_model_config(
        tmp_path / "w"
    )
    ModelSource(weights=str(tmp_path / "d" / "weights" / "final")).build(seed=0)
    assert "held-out exact" in capsys.readouterr().out
    args = ["lookup-drill", str(tmp_path / "w"), "--out", str(tmp_path / "both"), "--task", "both"]
    assert main([*args, "--steps", "2", "--batch", "4", "--eval-every", "2"]) == 0
    point = json.loads((tmp_path / "both" / "lookup_drill.json").read_text())["curve"][-1]
    assert {"exact_lookup", "exact_count", "loss_lookup", "loss_count"} <= set(point)
    assert point["exact"] == (point["exact_lookup"] + point["exact_count"]) / 2


def test_lookup_drill_errors_name_the_problem(tmp_path, capsys):
    save_params(Qwen3(tiny(), rngs=nnx.Rngs(0)), tmp_path / "w")
    base = ["lookup-drill", str(tmp_path / "w"), "--out", str(tmp_path / "d")]
    assert main([*base, "--steps", "0"]) == 2
    assert "--steps must be at least 1" in capsys.readouterr().err
    assert main([*base, "--max-lines", "30"]) == 2
    assert "--max-lines must be between" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["lookup-drill", str(tmp_path / "w"), "--out", str(tmp_path / "full")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["lookup-drill", str(tmp_path / "nope"), "--out", str(tmp_path / "e")]) == 2
    assert "not a simloop params checkpoint" in capsys.readouterr().err
