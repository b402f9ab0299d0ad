"""Importers: every shared SWE-agent trajectory imports faithfully; chat transcripts import;
broken files fail naming the file and the field; a batch import (and `simloop import`) keeps
the files that imported when one fails."""

import argparse
import json
import shutil
from pathlib import Path

import pytest

from launch.config.schema import SimloopConfig
from launch.jobs import import_trajectories
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.importers import (
    ImportConfig,
    TrajectoryImportError,
    import_file,
    import_files,
)
from rl.data.trajectory import read_jsonl, validate

RENDERER = ChatRenderer(ByteTokenizer())
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@pytest.fixture(scope="module")
def imported(swe_agent_trajectories):
    report = import_files([swe_agent_trajectories], "swe-agent", RENDERER, tokenizer_name="byte")
    return report


def test_every_shared_swe_agent_file_imports(swe_agent_trajectories, imported):
    files = sorted(swe_agent_trajectories.glob("*.traj"))
    assert len(files) >= 18
    assert imported.failed == []
    assert [p for p, _ in imported.imported] == files
    variants = set()
    for path, traj in imported.imported:
        raw = json.loads(path.read_text())
        steps = raw["trajectory"]
        validate(traj)
        assert traj.arm == "imported" and traj.source == "rendered"
        assert traj.behavior_logprobs is None and traj.policy_version is None
        assert traj.status == "ok" and traj.reward is None  # submitted; no score recorded
        assert len(traj.turns) == len(steps)
        for turn, step in zip(traj.turns, steps, strict=True):
            assert turn.command == step["action"].strip()
            assert turn.observation == step["observation"]
            assert turn.exit_code is None  # SWE-agent records none
        assert traj.instruction and "INSTRUCTIONS:" not in traj.instruction
        assert traj.prompt[0]["role"] == "system" and traj.prompt[-1]["role"] == "user"
        # The agent's tokens are exactly its replies; everything else is masked out.
        tok = RENDERER.tokenizer
        for turn in traj.turns:
            start, end = turn.token_span
            assert tok.decode(traj.token_ids[start:end]) == turn.agent_text + "<|im_end|>"
        assert sum(traj.loss_mask) == sum(e - s for s, e in (t.token_span for t in traj.turns))
        variants.add(traj.meta["variant"])
    assert variants == {"plain", "xml", "function_calling"}


def test_function_calls_render_as_tool_call_blocks(imported):
    fc = [t for _, t in imported.imported if t.meta["variant"] == "function_calling"]
    assert fc
    for traj in fc:
        called = [t for t in traj.turns if "<tool_call>" in t.agent_text]
        assert len(called) >= len(traj.turns) - 1  # a step the history lacks has no call
        for turn in called:
            block = turn.agent_text.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0]
            call = json.loads(block)
            assert set(call) == {"name", "arguments"}
        assert all(m["role"] == "tool" for t in called for m in t.env_messages)


def _corrupt(data, case):
    if case == "action_not_text":
        data["trajectory"][2]["action"] = 42
        return "trajectory[2].action"
    if case == "no_trajectory":
        del data["trajectory"]
        return "trajectory"
    if case == "bad_role":
        data["history"][0]["role"] = "narrator"
        return "history[0].role"
    if case == "step_not_object":
        data["trajectory"][1] = "ls"
        return "trajectory[1]"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["action_not_text", "no_trajectory", "bad_role", "step_not_object"]
)
def test_unreadable_input_names_file_and_field(swe_agent_trajectories, tmp_path, case):
    data = json.loads((swe_agent_trajectories / "ctf_crypto_eps.traj").read_text())
    field = _corrupt(data, case)
    path = tmp_path / "broken.traj"
    path.write_text(json.dumps(data))
    with pytest.raises(TrajectoryImportError) as err:
        import_file(path, "swe-agent")
    assert err.value.field == field
    assert str(path) in str(err.value) and f"'{field}'" in str(err.value)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "cut.traj"
    path.write_text('{"trajectory": [')
    with pytest.raises(TrajectoryImportError, match=r"cut\.traj: field '\(file\)': not valid JSON"):
        import_file(path, "swe-agent")


def _batch_dir(swe_agent_trajectories, tmp_path):
    src = sorted(swe_agent_trajectories.glob("*.traj"))[:3]
    for path in src:
        shutil.copy(path, tmp_path / path.name)
    data = json.loads(src[0].read_text())
    data["trajectory"][0]["observation"] = {"stdout": "not text"}
    (tmp_path / "zz_corrupt.traj").write_text(json.dumps(data))
    return src


def test_batch_import_reports_failures_and_keeps_the_rest(swe_agent_trajectories, tmp_path):
    src = _batch_dir(swe_agent_trajectories, tmp_path)
    report = import_files([tmp_path], "swe-agent", RENDERER)
    assert [p.name for p, _ in report.imported] == [p.name for p in src]
    assert len(report.failed) == 1
    path, message = report.failed[0]
    assert path.name == "zz_corrupt.traj" and "'trajectory[0].observation'" in message


def _args(paths, out, fmt="swe-agent"):
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--out")
    import_trajectories.add_arguments(parser)
    return parser.parse_args([*map(str, paths), "--format", fmt, "--out", str(out)])


def test_import_command_writes_good_files_and_fails(swe_agent_trajectories, tmp_path, capsys):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = _batch_dir(swe_agent_trajectories, src_dir)
    out = tmp_path / "run"
    rc = import_trajectories.run(_args([src_dir], out), SimloopConfig())
    captured = capsys.readouterr()
    assert rc == 1
    assert "zz_corrupt.traj" in captured.err and "'trajectory[0].observation'" in captured.err
    assert "files ok: 3" in captured.out and "failed: 1" in captured.out
    shards = sorted((out / "trajectories").glob("*.jsonl"))
    trajs = [t for shard in shards for t in read_jsonl(shard)]
    assert sorted(t.task_id for t in trajs) == sorted(p.stem for p in src)
    assert all(t.tokenizer == "byte" for t in trajs)
    assert (out / "config.yaml").exists()
    # All good: exit 0.
    (src_dir / "zz_corrupt.traj").unlink()
    assert import_trajectories.run(_args([src_dir], tmp_path / "run2"), SimloopConfig()) == 0


def test_import_config_validates():
    with pytest.raises(ValueError, match=r"ImportConfig\.format='jsonl' is invalid"):
        ImportConfig(format="jsonl")
    with pytest.raises(ValueError, match=r"ImportConfig\.shard_size=0 is invalid"):
        ImportConfig(shard_size=0)


MINI_SWE_AGENT = {
    "trajectory_format": "mini-swe-agent-1",
    "info": {"exit_status": "Submitted", "submission": "cba"},
    "messages": [
        {"role": "system", "content": "You are a helpful assistant that can run bash."},
        {"role": "user", "content": "<pr_description>\nReverse abc.\n</pr_description>"},
        {"role": "assistant", "content": "THOUGHT: look.\n\n```bash\nls -la\n```"},
        {"role": "user", "content": "<returncode>0</returncode>\n<output>\ninput.txt\n</output>"},
        {"role": "assistant", "content": "THOUGHT: two blocks.\n```bash\nls\n```\n```bash\nx\n```"},
        {"role": "user", "content": "Please always provide EXACTLY ONE action."},
        {"role": "assistant", "content": "```bash\ncat missing.txt\n```"},
        {
            "role": "user",
            "content": "<returncode>1</returncode>\n<output>\ncat: missing.txt: No such file\n"
            "</output>",
        },
        {
            "role": "assistant",
            "content": "```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
        },
    ],
}


def test_chat_mini_swe_agent_recovers_return_codes(tmp_path):
    path = tmp_path / "task-7.json"
    path.write_text(json.dumps(MINI_SWE_AGENT))
    traj = import_file(path, "chat", RENDERER)
    assert traj.status == "ok" and traj.task_id == "task-7"
    assert [t.command for t in traj.turns] == [
        "ls -la",
        None,
        "cat missing.txt",
        f"echo {SUBMIT_MARKER}",
    ]
    assert [t.exit_code for t in traj.turns] == [0, None, 1, None]
    assert traj.turns[0].observation == "input.txt"
    assert traj.turns[2].observation == "cat: missing.txt: No such file"
    assert traj.turns[1].flags == ["format_error"] and traj.turns[1].observation is None
    assert "Reverse abc." in traj.instruction
    assert len(traj.prompt) == 2 and traj.turns[-1].env_messages == []


def test_chat_openai_tool_calls(tmp_path):
    messages = [
        {"role": "developer", "content": "Use the bash tool."},
        {"role": "user", "content": [{"type": "text", "text": "Count files."}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "bash", "arguments": '{"command": "ls | wc -l"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3\n"},
        {"role": "assistant", "content": "There are 3 files."},
    ]
    path = tmp_path / "openai.json"
    path.write_text(json.dumps(messages))
    traj = import_file(path, "chat", RENDERER)
    assert traj.prompt[0]["role"] == "system"
    first = traj.turns[0]
    assert first.command == "ls | wc -l" and first.observation == "3\n"
    assert first.exit_code is None and first.env_messages == [{"role": "tool", "content": "3\n"}]
    assert first.agent_text.startswith("<tool_call>\n")
    assert traj.status == "aborted" and "no exit status" in traj.reason
    messages[2]["tool_calls"][0]["function"]["arguments"] = "{not json"
    path.write_text(json.dumps(messages))
    with pytest.raises(TrajectoryImportError, match=r"'\(root\)\[2\]\.tool_calls\[0\]\.function"):
        import_file(path, "chat")


# --- SWE-agent history-only files, mini-swe-agent trajectories, batch failures ---------------

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "importers"
DIFF = "diff --git a/app.py b/app.py"


def _spans_are_replies(traj):
    tok = RENDERER.tokenizer
    for turn in traj.turns:
        start, end = turn.token_span
        assert tok.decode(traj.token_ids[start:end]) == turn.agent_text + "<|im_end|>"


def test_swe_agent_history_only_imports_from_tool_calls():
    traj = import_file(FIXTURES / "swe_agent_history_only.traj", "swe-agent", RENDERER)
    assert traj.status == "ok" and traj.task_id == "swe_agent_history_only"
    assert traj.meta["turns_from"] == "history" and traj.meta["variant"] == "function_calling"
    # bash: its `command` argument; another tool: SWE-agent's `action`, else a command line.
    assert [t.command for t in traj.turns] == [
        "sed -i 's/Helo/Hello/' app.py",
        'open "app.py"',
        "submit",
    ]
    # The tool message answering each call, without SWE-agent's state lines.
    assert [t.observation for t in traj.turns] == [
        "",
        "[File: /repo/app.py (2 lines total)]\n1:def greet():\n2:    print('Hello')",
        DIFF + "\n--- a/app.py\n+++ b/app.py\n@@ -1,2 +1,2 @@\n def greet():\n"
        "-    print('Helo')\n+    print('Hello')\n",
    ]
    assert all(t.exit_code is None and t.flags == [] for t in traj.turns)
    first = traj.turns[0]
    assert first.agent_text.startswith("The typo is in app.py; fix it with sed.\n\n<tool_call>\n")
    assert first.env_messages[0]["role"] == "tool"
    assert first.env_messages[0]["content"].endswith("(Current directory: /repo)\nbash-$")
    assert traj.instruction.endswith("greet() prints 'Helo' instead of 'Hello'.")
    assert len(traj.prompt) == 2
    _spans_are_replies(traj)


def test_real_function_calling_files_import_from_history_alone(
    swe_agent_trajectories, imported, tmp_path
):
    full = {p.name: t for p, t in imported.imported if t.meta["variant"] == "function_calling"}
    assert full
    for name, whole in full.items():
        data = json.loads((swe_agent_trajectories / name).read_text())
        del data["trajectory"]
        path = tmp_path / name
        path.write_text(json.dumps(data))
        traj = import_file(path, "swe-agent", RENDERER)
        assert traj.meta["turns_from"] == "history" and traj.status == whole.status
        # The steps the transcript holds (one file's history lacks its final submit).
        steps = [t for t in whole.turns if "tool_call" not in t.info]
        assert len(steps) == whole.meta["turns_matched_in_history"] >= len(whole.turns) - 1
        assert [t.command for t in traj.turns] == [t.command for t in steps]
        # The replies' tool calls (two replies' texts differ between a step and the history).
        calls = [t.agent_text[t.agent_text.find("<tool_call>") :] for t in traj.turns]
        assert calls == [t.agent_text[t.agent_text.find("<tool_call>") :] for t in steps]
        assert [t.observation for t in traj.turns] == [t.observation for t in steps]
        assert [t.env_messages for t in traj.turns] == [t.env_messages for t in steps]


def test_mini_swe_agent_v2_tool_calls():
    traj = import_file(FIXTURES / "mini_v2_toolcall.traj.json", "mini-swe-agent", RENDERER)
    assert traj.task_id == "demo__greet-1" and traj.env_backend == "mini-swe-agent"
    assert traj.status == "ok" and traj.reason is None
    assert traj.instruction == "greet() prints 'Helo' instead of 'Hello'."
    assert traj.meta["submission"].startswith(DIFF) and traj.meta["exit_status"] == "Submitted"
    assert traj.meta["trajectory_format"] == "mini-swe-agent-1.1"
    assert traj.meta["format_error_messages"] == 1 and traj.meta["model_name"] == "test/model"
    look, fix, submit = traj.turns
    assert look.command == "cat app.py" and look.exit_code == 0
    assert look.observation == "def greet():\n    print('Helo')\n"  # raw_output, not the JSON
    assert look.timings == {"env_s": 0.5}
    # The format error (its reply was not kept) is what the agent was shown next.
    assert [m["role"] for m in look.env_messages] == ["tool", "user"]
    assert fix.command == "sed -i 's/Helo/Hello/' app.py" and fix.observation == ""
    assert fix.info["more_commands"] == ["python -c 'import app; app.greet()'"]
    assert fix.agent_text.count("<tool_call>") == 2
    # The exit message is no observation: the agent never saw it.
    assert submit.env_messages == [] and submit.observation is None
    _spans_are_replies(traj)


def test_mini_swe_agent_v2_text_based_limits():
    traj = import_file(FIXTURES / "mini_v2_textbased_limits.traj.json", "mini-swe-agent")
    assert traj.task_id == "mini_v2_textbased_limits"
    assert traj.status == "truncated" and "LimitsExceeded" in traj.reason
    assert traj.instruction == "Print the notes file."
    missing, sleep = traj.turns
    assert missing.command == "cat missing.txt" and missing.exit_code == 1
    assert missing.observation == "cat: missing.txt: No such file or directory\n"
    assert sleep.command == "sleep 100" and sleep.exit_code == -1
    assert sleep.flags == ["timeout"] and "timed out" in sleep.info["exception"]
    assert traj.meta["submission"] == ""


@pytest.mark.parametrize("fmt", ["mini-swe-agent", "chat"])
def test_mini_swe_agent_v1_drops_the_closing_submission(fmt):
    traj = import_file(FIXTURES / "mini_v1.traj.json", fmt, RENDERER)
    assert traj.meta["source_format"] == "mini-swe-agent"  # `chat` detects the format
    assert traj.status == "ok" and traj.meta["submission"].startswith(DIFF)
    assert [t.exit_code for t in traj.turns] == [0, None]
    assert traj.turns[0].observation == "def greet():\n    print('Helo')"
    assert traj.turns[-1].env_messages == [] and traj.turns[-1].observation is None


@pytest.mark.parametrize(
    ("exit_status", "status", "in_reason"),
    [
        ("Submitted", "ok", None),
        ("LimitsExceeded", "truncated", "LimitsExceeded"),
        ("RepeatedFormatError", "truncated", "RepeatedFormatError"),
        ("TimeExceeded", "timeout", "TimeExceeded"),
        ("RuntimeError", "error", "'RuntimeError': docker died"),
        ("", "aborted", "no exit status"),
    ],
)
def test_mini_swe_agent_status(tmp_path, exit_status, status, in_reason):
    data = json.loads((FIXTURES / "mini_v1.traj.json").read_text())
    data["info"].update(exit_status=exit_status, exception_str="docker died")
    path = tmp_path / "run.traj.json"
    path.write_text(json.dumps(data))
    traj = import_file(path, "mini-swe-agent")
    assert traj.status == status
    assert traj.reason is None if in_reason is None else in_reason in traj.reason


def _corrupt_mini(data, case):
    if case == "no_messages":
        del data["messages"]
        return "messages"
    if case == "not_mini":
        data["trajectory_format"] = "swe-agent-1"
        return "trajectory_format"
    if case == "message_not_object":
        data["messages"][3] = "ok"
        return "messages[3]"
    if case == "action_not_text":
        data["messages"][2]["extra"]["actions"][0]["command"] = ["cat", "app.py"]
        return "messages[2].extra.actions[0].command"
    if case == "arguments_not_json":
        data["messages"][5]["tool_calls"][1]["function"]["arguments"] = '{"command": '
        return "messages[5].tool_calls[1].function.arguments"
    if case == "exit_status_not_text":
        data["info"]["exit_status"] = 0
        return "info.exit_status"
    raise AssertionError(case)


MINI_CASES = [
    "no_messages",
    "not_mini",
    "message_not_object",
    "action_not_text",
    "arguments_not_json",
    "exit_status_not_text",
]


@pytest.mark.parametrize("case", MINI_CASES)
def test_mini_swe_agent_unreadable_input_names_file_and_field(tmp_path, case):
    data = json.loads((FIXTURES / "mini_v2_toolcall.traj.json").read_text())
    field = _corrupt_mini(data, case)
    path = tmp_path / "broken.traj.json"
    path.write_text(json.dumps(data))
    with pytest.raises(TrajectoryImportError) as err:
        import_file(path, "mini-swe-agent")
    assert err.value.field == field
    assert str(path) in str(err.value) and f"'{field}'" in str(err.value)


def _write(path, data):
    path.write_text(data if isinstance(data, str) else json.dumps(data))


def test_batch_import_of_new_formats_names_each_corrupt_file(tmp_path):
    mini = tmp_path / "mini"
    (mini / "nested").mkdir(parents=True)
    good = sorted(FIXTURES.glob("*.traj.json"))
    for path in good:
        shutil.copy(path, mini / "nested" / path.name)
    data = json.loads(good[0].read_text())
    del data["messages"]
    _write(mini / "zz_no_messages.traj.json", data)
    _write(mini / "zz_cut.traj.json", '{"messages": [')
    _write(mini / "zz_list.traj.json", [1, 2])
    _write(mini / "zz_number.traj.json", "1" * 5000)  # valid JSON Python will not parse
    (mini / "zz_folder.traj.json").mkdir()
    _write(mini / "preds.json", {})  # not a trajectory: not matched by *.traj.json
    swe = tmp_path / "swe"
    swe.mkdir()
    history_only = json.loads((FIXTURES / "swe_agent_history_only.traj").read_text())
    for name in ("a.traj", "b.traj"):
        _write(swe / name, history_only)
    history_only["history"][2]["tool_calls"] = 42
    _write(swe / "zz_corrupt.traj", history_only)
    _write(swe / "zz_cut.traj", '{"history": [')

    report = import_files([mini], "mini-swe-agent", RENDERER)
    assert [p.name for p, _ in report.imported] == [p.name for p in good]
    failed = {p.name: message for p, message in report.failed}
    assert set(failed) == {
        "zz_no_messages.traj.json",
        "zz_cut.traj.json",
        "zz_list.traj.json",
        "zz_number.traj.json",
        "zz_folder.traj.json",
    }
    for name, message in failed.items():
        assert name in message and "Traceback" not in message
    assert "field 'messages': is missing" in failed["zz_no_messages.traj.json"]
    assert "field '(file)': not valid JSON" in failed["zz_cut.traj.json"]
    assert "field '(root)': expected a JSON object, got list" in failed["zz_list.traj.json"]
    assert "field '(file)': not valid JSON" in failed["zz_number.traj.json"]
    assert "field '(file)': cannot read" in failed["zz_folder.traj.json"]

    report = import_files([swe], "swe-agent", RENDERER)
    assert [p.name for p, _ in report.imported] == ["a.traj", "b.traj"]
    failed = {p.name: message for p, message in report.failed}
    assert (
        "field 'history[2].tool_calls': expected a list of tool calls, got int"
        in failed["zz_corrupt.traj"]
    )
    assert "field '(file)': not valid JSON" in failed["zz_cut.traj"]


def test_an_importer_bug_is_a_named_failure_not_a_traceback(tmp_path, monkeypatch):
    from rl.data import importers

    path = tmp_path / "ok.traj.json"
    shutil.copy(FIXTURES / "mini_v1.traj.json", path)

    def broken(data, path):
        return data["messages"][99]

    monkeypatch.setitem(importers.IMPORTERS, "mini-swe-agent", broken)
    with pytest.raises(TrajectoryImportError, match=r"ok\.traj\.json: field '\(unknown\)': Index"):
        import_file(path, "mini-swe-agent")

    def worse(data, path):
        raise RuntimeError("boom")

    monkeypatch.setitem(importers.IMPORTERS, "mini-swe-agent", worse)
    report = import_files([tmp_path], "mini-swe-agent")
    assert report.imported == []
    assert report.failed == [(path, f"{path}: RuntimeError: boom")]


def test_import_command_mini_swe_agent(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for path in FIXTURES.glob("*.traj.json"):
        shutil.copy(path, src / path.name)
    _write(src / "zz_cut.traj.json", "{")
    assert ImportConfig(format="mini-swe-agent").format == "mini-swe-agent"
    rc = import_trajectories.run(_args([src], tmp_path / "run", "mini-swe-agent"), SimloopConfig())
    captured = capsys.readouterr()
    assert rc == 1 and "zz_cut.traj.json" in captured.err
    assert "files ok: 3" in captured.out and "failed: 1" in captured.out
    trajs = read_jsonl(next((tmp_path / "run" / "trajectories").glob("*.jsonl")))
    assert sorted(t.task_id for t in trajs) == [
        "demo__greet-1",
        "mini_v1",
        "mini_v2_textbased_limits",
    ]
