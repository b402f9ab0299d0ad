"""Importers against hostile files: one bad file never loses or hangs the batch. Each failure
is named (file and reason) and the others import and are written; only regular files are read;
parsing is linear in the input; lone surrogates are replaced (U+FFFD) and counted."""

import argparse
import json
import os
import time

import pytest

from launch.config.schema import SimloopConfig
from launch.jobs import import_trajectories
from rl.data.importers import _swe_observation, import_file, import_files
from rl.data.importers_common import chat_observation
from rl.data.importers_mini import _task
from rl.data.trajectory import read_jsonl

GOOD = [
    {"role": "user", "content": "Reverse abc."},
    {"role": "assistant", "content": "```bash\nrev <<< abc\n```"},
    {"role": "user", "content": "<returncode>0</returncode>\n<output>\ncba\n</output>"},
]
LINEAR_S = 0.5  # 128 KB parses in milliseconds; the old regexes took 15 s to forever


def _chat(path, messages, **top):
    path.write_text(json.dumps({"messages": messages, **top}) if top else json.dumps(messages))
    return path


def _run(src, out, fmt="chat"):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--out")
    import_trajectories.add_arguments(parser)
    args = parser.parse_args([str(src), "--format", fmt, "--out", str(out)])
    return import_trajectories.run(args, SimloopConfig())


def test_lone_surrogate_is_replaced_and_the_shard_written(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _chat(src / "a_good.json", GOOD)
    # JSON may escape a lone surrogate, which no UTF-8 shard can hold: it used to crash the
    # shard write and lose every trajectory of the batch.
    text = json.dumps(GOOD).replace("cba", "c\\ud800a").replace("Reverse", "Rev\\udfffrse")
    (src / "b_surrogate.json").write_text(text)
    assert _run(src, tmp_path / "run") == 0, capsys.readouterr().err
    trajs = read_jsonl(next((tmp_path / "run" / "trajectories").glob("*.jsonl")))
    assert [t.task_id for t in trajs] == ["a_good", "b_surrogate"]
    bad = trajs[1]
    assert bad.turns[0].observation == "c\ufffda" and bad.instruction == "Rev\ufffdrse abc."
    assert bad.meta["replaced_lone_surrogates"] == 2  # in the instruction and the output
    assert "replaced_lone_surrogates" not in trajs[0].meta


def test_deep_json_is_a_named_failure_and_the_rest_are_written(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    _chat(src / "a_good.json", GOOD)
    (src / "b_deep.json").write_text("[" * 100_000 + "]" * 100_000)
    # Shallow enough to parse, too deep to serialise: it used to fail only at write time.
    (src / "c_deep_field.json").write_text(
        json.dumps({"messages": GOOD, "info": {"exit_status": "@"}}).replace(
            '"@"', "[" * 900 + "1" + "]" * 900
        )
    )
    assert _run(src, tmp_path / "run") == 1
    err = capsys.readouterr().err
    assert "b_deep.json: field '(file)': not valid JSON: maximum recursion depth" in err
    assert "c_deep_field.json: field '(trajectory)': maximum recursion depth" in err
    trajs = read_jsonl(next((tmp_path / "run" / "trajectories").glob("*.jsonl")))
    assert [t.task_id for t in trajs] == ["a_good"]


def test_only_regular_files_are_read(tmp_path):
    good = _chat(tmp_path / "a_good.json", GOOD)
    os.mkfifo(tmp_path / "b_fifo.json")  # no writer: reading it would block forever
    (tmp_path / "c_folder.json").mkdir()
    start = time.monotonic()
    report = import_files([tmp_path, "/dev/zero"], "chat")
    assert time.monotonic() - start < 5
    assert [p for p, _ in report.imported] == [good]
    failed = {p.name: message for p, message in report.failed}
    assert "cannot read: not a regular file (a FIFO), skipped" in failed["b_fifo.json"]
    assert "cannot read: not a regular file (a folder), skipped" in failed["c_folder.json"]
    assert "not a regular file (a character device)" in failed["zero"]
    assert all(str(p) in message for p, message in report.failed)  # each names its file


def test_fifo_named_traj_does_not_hang_the_swe_agent_import(tmp_path):
    os.mkfifo(tmp_path / "x.traj")
    report = import_files([tmp_path], "swe-agent")
    assert len(report.failed) == 1 and "a FIFO" in report.failed[0][1]


def _timed(fn, text):
    start = time.perf_counter()
    result = fn(text)
    assert time.perf_counter() - start < LINEAR_S, (fn.__name__, len(text))
    return result


N = 128 * 1024


def test_output_parsing_is_linear_on_128_kb():
    assert _timed(chat_observation, "<output>" * (N // 8)) == ("<output>" * (N // 8), None)
    assert _timed(chat_observation, "<output>\n" * (N // 9))[1] is None
    big = "x" * N
    assert _timed(chat_observation, f"<returncode>2</returncode><output>\n{big}\n</output>") == (
        big,
        2,
    )
    assert _timed(_task, "<pr_description>" * (N // 16)).startswith("<pr_description>")
    assert _timed(_task, "Please solve this issue: " * (N // 25)).startswith("Please solve")


def test_swe_agent_state_lines_strip_in_linear_time():
    # `(A: x)` repeated: the old regex backtracked exponentially (120 bytes took 0.5 s).
    assert _timed(_swe_observation, "(A: x)" * (N // 6)) == "(A: x)" * (N // 6)
    lines = "\n(Open file: a.py)" * (N // 18)
    assert _timed(_swe_observation, f"out{lines}\nbash-$ ") == "out"
    assert _timed(_swe_observation, "(" * N + ") bash-$") == "(" * N + ") bash-$"


@pytest.mark.parametrize(
    ("content", "observation"),
    [
        ("hi\n(Open file: n/a)\n(Current directory: /r)\nbash-$", "hi"),
        ("hi (Open file: a)\nbash-$", "hi "),
        ("(Open file: a)\n\nbash-$", "(Open file: a)\n\nbash-$"),  # a blank line ends the state
        ("hi\n(open file: a)\nbash-$", "hi\n(open file: a)\nbash-$"),  # not a state line
        ("(Open file: a)\nbash-$", ""),
        ("Your command ran successfully and did not produce any output.\n(A: b)\nbash-$", ""),
    ],
)
def test_swe_agent_state_lines_are_stripped_as_before(content, observation):
    assert _swe_observation(content) == observation


def test_output_block_keeps_its_meaning():
    assert chat_observation("<output>\n</output>") == ("", None)
    assert chat_observation("<returncode>1</returncode>\n<output>\na\n\n</output>") == ("a\n", 1)
    assert chat_observation("<output>a</output><output>b</output>") == ("a", None)


def test_a_surrogate_in_a_field_name_is_replaced_too(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(json.dumps(GOOD)[:-1] + ', {"role": "user", "content": "x", "\\udc80": 1}]')
    traj = import_file(path, "chat")
    assert traj.meta["replaced_lone_surrogates"] == 1
