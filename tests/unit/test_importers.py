"""Importers: every shared SWE-agent trajectory imports faithfully; chat transcripts import;
broken files fail naming the file and the field; a batch import (and `simloop import`) keeps
the files that imported when one fails."""

import argparse
import json
import shutil

import pytest

from launch import import_cmd
from launch.schema import SimloopConfig
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
    import_cmd.add_arguments(parser)
    return parser.parse_args([*map(str, paths), "--format", fmt, "--out", str(out)])


def test_import_command_writes_good_files_and_fails(swe_agent_trajectories, tmp_path, capsys):
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    src = _batch_dir(swe_agent_trajectories, src_dir)
    out = tmp_path / "run"
    rc = import_cmd.run(_args([src_dir], out), SimloopConfig())
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
    assert import_cmd.run(_args([src_dir], tmp_path / "run2"), SimloopConfig()) == 0


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
