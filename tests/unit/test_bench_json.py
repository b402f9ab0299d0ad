"""Benches speak JSON: `--json PATH` writes every bench's rows in one shape (bench/results.py),
checked on the helper itself and on the cheapest runs of two real benches."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"measure", "ours", "peer", "ratio", "ratio_of", "target", "unit"}

_spec = importlib.util.spec_from_file_location("bench_results", REPO / "bench" / "results.py")
results = sys.modules["bench_results"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def _check_document(doc: dict, bench: str) -> list[dict]:
    """The common shape, field by field; returns the rows."""
    assert doc["bench"] == bench
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert doc["commit"] == head.stdout.strip()
    assert doc["rows"]
    for row in doc["rows"]:
        assert set(row) == ROW_KEYS
        assert isinstance(row["measure"], str) and row["measure"]
        assert isinstance(row["unit"], str)
        assert isinstance(row["ours"], int | float)
        assert row["peer"] is None or isinstance(row["peer"], int | float)
        assert row["target"] is None or isinstance(row["target"], int | float | str)
        assert row["ratio_of"] in ("ours/peer", "peer/ours")
        if row["peer"] is None or 0 in (row["ours"], row["peer"]):
            assert row["ratio"] is None
        else:
            num, den = row["ours"], row["peer"]
            if row["ratio_of"] == "peer/ours":
                num, den = den, num
            assert row["ratio"] == pytest.approx(num / den)
    return doc["rows"]


def test_write_json_puts_rows_in_the_common_shape_and_keeps_the_detail(tmp_path):
    rows = [
        results.Row("decode tiny B=8", 500.0, 100.0, "tokens/s", ">= 3x"),
        results.Row(
            "64 requests: concurrent vs one at a time", 2.0, 30.0, "s", 10, ratio_of="peer/ours"
        ),
        results.Row("overhead per turn", 0.15, None, "ms", "< 0.2 ms"),
        results.Row("max staleness", 2, 0, "versions"),  # a zero peer: no ratio
        results.Row("latency CV", float("nan"), float("inf"), ""),  # JSON has no nan/inf
    ]
    out = tmp_path / "bench.json"
    detail = {"decode": {"engine_tok_s": 500.0}}
    written = results.write_json(out, "engine_throughput", rows, detail)
    doc = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert doc == written and doc["detail"] == detail
    got = [(r["ours"], r["peer"], r["ratio"], r["target"], r["unit"]) for r in doc["rows"]]
    assert got == [
        (500.0, 100.0, 5.0, ">= 3x", "tokens/s"),
        (2.0, 30.0, 15.0, 10, "s"),
        (0.15, None, None, "< 0.2 ms", "ms"),
        (2, 0, None, None, "versions"),
        (None, None, None, None, ""),
    ]
    assert doc["rows"][0]["measure"] == "decode tiny B=8"
    assert [r["ratio_of"] for r in doc["rows"][:2]] == ["ours/peer", "peer/ours"]


def test_a_row_with_an_unknown_ratio_is_refused():
    with pytest.raises(ValueError, match=r"ratio_of='ours-peer'.*'ours/peer', 'peer/ours'"):
        results.Row("x", 1.0, 2.0, "s", ratio_of="ours-peer")


def test_json_path_in_a_missing_folder_is_refused_before_the_bench_runs(tmp_path, capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="bench")
    results.add_json_flag(parser)
    assert parser.parse_args(["--json", str(tmp_path / "a.json")]).json == tmp_path / "a.json"
    for bad, why in [(tmp_path / "nope" / "a.json", "does not exist"), (tmp_path, "directory")]:
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--json", str(bad)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--json" in err and why in err and "Traceback" not in err


def _run_bench(script: str, *args: str, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, f"bench/{script}.py", *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_orchestrator_bench_writes_overhead_and_memory_rows(tmp_path):
    doc = _run_bench(
        "orchestrator_overhead", "--episodes", "100", "--turns", "3", out=tmp_path / "orch.json"
    )
    rows = {r["measure"]: r for r in _check_document(doc, "orchestrator_overhead")}
    for n in (1, 64, 100):
        assert rows[f"overhead per turn, {n} in flight"]["unit"] == "ms"
        assert rows[f"overhead per turn, {n} in flight"]["ours"] > 0
    assert rows["overhead per turn, 100 in flight"]["target"] == "< 0.2 ms"
    assert rows["episodes in flight at once"]["ours"] == 100
    assert rows["peak RSS (ru_maxrss)"]["ours"] > 10  # MiB: at least the interpreter
    assert 0 < rows["RSS per episode in flight"]["ours"] < 10_000  # KiB
    assert [(r["concurrency"], r["ok"]) for r in doc["detail"]] == [(1, 100), (64, 100), (100, 100)]


def test_model_bench_without_a_peer_writes_null_peers(tmp_path):
    doc = _run_bench(
        "model_forward",
        "--sizes",
        "tiny",
        "--repeats",
        "1",
        "--seq",
        "16",
        "--prompt",
        "4",
        "--decode-steps",
        "2",
        "--no-hf",
        out=tmp_path / "model.json",
    )
    rows = _check_document(doc, "model_forward")
    assert [r["measure"] for r in rows] == ["forward tiny B=8 T=16", "decode tiny B=8 prompt 4 +2"]
    assert all(r["peer"] is None and r["unit"] == "tokens/s" and r["ours"] > 0 for r in rows)
    assert doc["detail"][0]["size"] == "tiny"


def test_a_bench_refuses_a_bad_json_path_without_a_traceback(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "bench/orchestrator_overhead.py",
            "--json",
            str(tmp_path / "missing" / "o.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stderr and "Traceback" not in done.stderr
