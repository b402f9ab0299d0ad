"""Task schema and JSONL, the reward registry, and the textops generator."""

import json

import pytest

from envs.config import ShellConfig, TextopsConfig
from envs.rewards import (
    RewardContext,
    compute_reward,
    get_reward,
    register_reward,
    reward_names,
)
from envs.shell import TaskSetup
from envs.tasks import RewardSpec, Task, load_tasks, save_tasks
from envs.textops import generate_textops, textops_truth


def test_tasks_round_trip_through_jsonl(tmp_path):
    tasks = generate_textops(TextopsConfig(num_tasks=20, seed=1, from_file_prob=0.5))
    tasks.append(
        Task(
            "custom",
            "Print ok.",
            setup=TaskSetup(files={"d/x.txt": "1\n"}, commands=("true",)),
            reward=RewardSpec("exact_match", {"expected": "ok"}),
            metadata={"source": "test"},
        )
    )
    path = save_tasks(tmp_path / "tasks.jsonl", tasks)
    assert load_tasks(path) == tasks


def test_minimal_task_line_gets_defaults(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "a", "instruction": "do"}) + "\n\n")
    (task,) = load_tasks(path)
    assert task.setup == TaskSetup() and task.reward.name == "exact_match"


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"id": "a"}', r"t.jsonl:2: task is missing 'instruction'"),
        (
            '{"id": "a", "instruction": "x", "rewards": {}}',
            r":2: unknown task key\(s\) \['rewards'\]",
        ),
        ('{"id": "a", "instruction": "x", "setup": {"files": {"/etc/x": ""}}}', r"relative path"),
        ('{"id": "a", "instruction": "x", "setup": {"files": {"../x": ""}}}', r"relative path"),
        ("not json", r"t.jsonl:2: Expecting value"),
        ('{"id": "first", "instruction": "again"}', r":2: duplicate task id 'first'"),
    ],
)
def test_bad_task_lines_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "first", "instruction": "x"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_tasks(path)


def test_textops_is_seeded_and_truth_is_computed_from_params():
    cfg = TextopsConfig(num_tasks=30, seed=7)
    assert generate_textops(cfg) == generate_textops(cfg)
    assert generate_textops(cfg) != generate_textops(TextopsConfig(num_tasks=30, seed=8))
    assert textops_truth({"op": "reverse", "text": "abc"}) == "cba"
    assert textops_truth({"op": "upper", "text": "abc"}) == "ABC"
    assert textops_truth({"op": "sort", "text": "cab"}) == "abc"
    assert textops_truth({"op": "count", "text": "banana", "char": "a"}) == "3"
    assert textops_truth({"op": "write_read", "text": "memo", "path": "n/x.txt"}) == "memo"
    for task in generate_textops(cfg):
        params = task.reward.params
        in_text = params["text"] in task.instruction
        assert in_text != params["from_file"]  # the word is in exactly one place
        if params["from_file"]:
            assert task.setup.files == {"input.txt": params["text"] + "\n"}


async def test_reward_registry():
    assert {"exact_match", "textops", "swe_tests"} <= set(reward_names())
    task = generate_textops(TextopsConfig(num_tasks=1, seed=2, ops=["sort"]))[0]
    truth = textops_truth(dict(task.reward.params))
    assert await compute_reward(task, f"  {truth}\n") == 1.0
    assert await compute_reward(task, truth + "z") == 0.0
    assert await compute_reward(task, None) == 0.0

    @register_reward("test_length")
    async def length_reward(task, submission, ctx):
        return len(submission) / 10

    custom = Task("c", "x", reward=RewardSpec("test_length"))
    assert await compute_reward(custom, "abcde", RewardContext()) == 0.5
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_length")(lambda *a: 0.0)
    with pytest.raises(ValueError, match=r"reward 'nope' is unknown: one of \["):
        get_reward("nope")


async def test_swe_reward_needs_a_shell_factory():
    task = Task("s", "x", reward=RewardSpec("swe_tests", {"test_command": "true"}))
    with pytest.raises(ValueError, match="needs RewardContext.shell_factory"):
        await compute_reward(task, "diff")


def test_config_validation():
    with pytest.raises(ValueError, match=r"TextopsConfig.ops=\['rot13'\] is invalid"):
        TextopsConfig(ops=["rot13"])
    with pytest.raises(ValueError, match=r"TextopsConfig.max_len=2 is invalid: at least min_len"):
        TextopsConfig(min_len=4, max_len=2)
    with pytest.raises(ValueError, match=r"ShellConfig.backend='docker' is invalid"):
        ShellConfig(backend="docker")
