"""envs/fileops.py: the stateful task family. Every task's truth is what its steps leave in a
real bash workspace; the scripted solver reaches it with and without each of its mistakes;
episodes are 3-8 commands whose later commands read what earlier ones wrote."""

from __future__ import annotations

import dataclasses
import re

import pytest

from envs.config import FILEOPS_KINDS, FileopsConfig, TerminalConfig
from envs.fileops import (
    MISTAKES,
    SLIPS,
    WORDS,
    FileopsSolver,
    fileops_reward,
    fileops_truth,
    generate_fileops,
    plan,
    split_fileops,
)
from envs.local import LocalShell
from envs.terminal import TerminalEnv

TERMINAL = TerminalConfig(max_turns=10)


async def solve(task, **solver) -> tuple[list, TerminalEnv]:
    agent = FileopsSolver(task, **solver)
    async with LocalShell(setup=task.setup) as sh:
        env = TerminalEnv(task, sh, TERMINAL)
        observation = await env.reset()
        results = []
        while not env.done:
            result = await env.step(agent.act(observation))
            results.append(result)
            observation = result.observation
    return results, env


async def test_the_solver_solves_every_kind_in_real_bash_and_the_truth_is_what_bash_left():
    tasks = generate_fileops(FileopsConfig(num_tasks=12, seed=1))
    assert {t.metadata["kind"] for t in tasks} == set(FILEOPS_KINDS)
    for task in tasks:
        results, env = await solve(task)
        assert results[-1].reward == 1.0, (task.instruction, env.submission)
        assert env.submission.strip() == fileops_truth(dict(task.reward.params))
        commands = len(plan(dict(task.reward.params)))
        assert 3 <= commands <= 8 and len(results) == commands + 1  # + the submission
        assert all(r.info.get("exit_code", 0) == 0 for r in results[:-1]), task.instruction


@pytest.mark.parametrize("mistake", MISTAKES)
async def test_each_mistake_shows_in_the_episode_and_is_recovered_from(mistake):
    found = 0
    for task in generate_fileops(FileopsConfig(num_tasks=24, seed=2)):
        for seed in range(40):
            solver = FileopsSolver(task, noise=1.0, seed=seed)
            if solver.mistake == mistake:
                break
        else:
            continue
        results, env = await solve(task, noise=1.0, seed=seed)
        assert results[-1].reward == 1.0, (mistake, solver.commands, env.submission)
        assert len(results) == len(plan(dict(task.reward.params))) + 2  # one extra command
        if mistake in ("typo", "failed_retry"):
            assert any(r.info.get("exit_code", 0) != 0 for r in results[:-1]), solver.commands
        extra = [c for c in solver.commands if c not in plan(dict(task.reward.params))]
        if mistake == "early_read":  # a file read before the step that writes it: missing,
            # or (appended to) what it held before; either way not what it holds after
            assert len(extra) == 1 and extra[0].split()[0] in ("cat", "ls"), solver.commands
        found += 1
    assert found >= 10, f"only {found} tasks drew {mistake}"


def test_tasks_are_seeded_and_the_held_out_split_is_prefix_stable():
    cfg = FileopsConfig(num_tasks=8, seed=3)
    assert generate_fileops(cfg) == generate_fileops(cfg)
    train, held = split_fileops(cfg, 4)
    assert train == generate_fileops(cfg) and len(held) == 4
    assert not {t.id for t in train} & {t.id for t in held}
    # Distractors: files no step reads or writes.
    for task in train:
        named = set(task.setup.files) - {"input.txt", "log.txt"}
        assert any(not f.startswith("inbox/") for f in named), task.setup.files


def test_max_k_caps_the_lines_head_and_tail_keep():
    def ks(tasks):
        return [s["k"] for t in tasks for s in t.reward.params.get("steps", []) if "k" in s]

    base = FileopsConfig(num_tasks=80, seed=5, kinds=["chain", "fanout"], max_lines=6)
    assert max(ks(generate_fileops(base))) == 5  # up to the input's lines minus one
    assert set(ks(generate_fileops(dataclasses.replace(base, max_k=3)))) == {2, 3}
    two = generate_fileops(dataclasses.replace(base, max_k=2))
    assert set(ks(two)) == {2}
    said = [n for t in two for n in re.findall(r"its (?:first|last) (\d+) lines", t.instruction)]
    assert said and set(said) == {"2"}
    with pytest.raises(ValueError, match=r"max_k=1 is invalid: an integer >= 2"):
        FileopsConfig(max_k=1)


async def test_random_words_are_fresh_strings_the_solver_still_solves_in_real_bash():
    tasks = generate_fileops(FileopsConfig(num_tasks=40, seed=6, words="random"))
    words = set()
    for t in tasks:
        p = t.reward.params
        words |= set(p.get("lines", []) + p.get("existing", []))
        words |= {a.rsplit("-", 1)[0] for a in p.get("appended", [])}
        words |= {n.removesuffix(".txt") for n in p.get("inbox", [])}
    # Fresh strings of 4-7 lowercase letters, far more of them than the fixed list's 26.
    assert len(words) > 100 and all(re.fullmatch(r"[a-z]{4,7}", w) for w in words), words
    for kind in FILEOPS_KINDS:
        task = next(t for t in tasks if t.metadata["kind"] == kind)
        _, env = await solve(task, style="marker")
        assert env.reward == 1.0, (kind, task.setup.files)
    # The fixed words draw as they always did: the held-out collections (seed 11) depend on it.
    first = generate_fileops(FileopsConfig(num_tasks=1, seed=11))[0]
    assert first.instruction.startswith("1. Write `input.txt` with its lines in upper case")
    assert set(first.setup.files["input.txt"].split()) <= set(WORDS)
    # `mixed`: each task is one or the other, and both come up.
    mixed = generate_fileops(FileopsConfig(num_tasks=40, seed=6, words="mixed"))
    by = {w: [t for t in mixed if t.metadata["words"] == w] for w in ("fixed", "random")}
    assert len(by["fixed"]) + len(by["random"]) == 40 and by["fixed"] and by["random"]
    for t in by["fixed"]:
        p = t.reward.params
        assert set(p.get("lines", []) + p.get("existing", [])) <= set(WORDS), t.id
    assert any(set(t.reward.params.get("lines", [])) - set(WORDS) for t in by["random"])
    with pytest.raises(ValueError, match=r"words='some' is invalid: one of \('fixed', 'random', "):
        FileopsConfig(words="some")


async def test_a_wrong_or_missing_submission_earns_nothing():
    from envs.rewards import RewardContext, get_reward

    task = generate_fileops(FileopsConfig(num_tasks=1, seed=4))[0]
    reward = get_reward("fileops")
    truth = fileops_truth(dict(task.reward.params))
    assert await reward(task, f"  {truth}\n", RewardContext()) == 1.0
    assert await reward(task, truth + "x", RewardContext()) == 0.0
    assert await reward(task, None, RewardContext()) == 0.0


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="kinds"):
        FileopsConfig(kinds=["chain", "nope"])
    with pytest.raises(ValueError, match="min_lines"):
        FileopsConfig(min_lines=2)
    with pytest.raises(ValueError, match="distractors"):
        dataclasses.replace(FileopsConfig(), distractors=9)
    from launch.config.schema import EnvConfig

    with pytest.raises(ValueError, match=r"EnvConfig.family='files' is invalid"):
        EnvConfig(family="files")
    from launch.config.schema import CollectConfig
    from rl.data import ByteTokenizer
    from rl.orchestrator.scripted import ScriptedAgentClient

    for bad in (["nap"], []):
        with pytest.raises(ValueError, match=r"fileops_mistakes=.* drawn from \['early_read'"):
            CollectConfig(fileops_mistakes=bad)
        with pytest.raises(ValueError, match="fileops_mistakes"):
            ScriptedAgentClient([], ByteTokenizer(), fileops_mistakes=bad)


async def test_scripted_fileops_episodes_through_the_runner_in_real_bash():
    """What `simloop collect --env.family fileops` runs: the scripted agent client (its
    mistakes drawn per episode) through the orchestrator, real bash per episode."""
    from envs.local import LocalShell
    from rl.data import ByteTokenizer, ChatRenderer
    from rl.data.trajectory import validate
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import Backends, RolloutRunner
    from rl.orchestrator.scripted import ScriptedAgentClient

    tasks = generate_fileops(FileopsConfig(num_tasks=6, seed=6))
    renderer = ChatRenderer(ByteTokenizer())
    client = ScriptedAgentClient(tasks, renderer.tokenizer, noise=0.5, seed=1)
    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=1, max_context_tokens=4096,
                           max_tokens_per_turn=256),
        TERMINAL,
        renderer,
        Backends(real=lambda task: LocalShell(setup=task.setup)),
        client=client,
    )  # fmt: skip
    trajs = await runner.run(tasks)
    assert len(trajs) == 6
    for t, task in zip(trajs, tasks, strict=True):
        validate(t)
        # The client's solver, as it draws its mistakes (the slips too: other_op is among the
        # client's default noise kinds).
        solver = FileopsSolver(task, noise=0.5, seed=1, mistakes=MISTAKES + SLIPS)
        assert t.status == "ok", (task.instruction, t.status, t.reason)
        assert [turn.command for turn in t.turns[:-1]] == solver.commands
        if solver.mistake != "other_op":  # every other mistake is recovered from
            assert t.reward == 1.0, (task.instruction, solver.commands)
    assert any(
        FileopsSolver(t, noise=0.5, seed=1, mistakes=MISTAKES + SLIPS).mistake for t in tasks
    )


async def test_marker_style_submits_the_last_commands_output_without_copying_it():
    for task in generate_fileops(FileopsConfig(num_tasks=6, seed=4)):
        results, env = await solve(task, style="marker")
        assert results[-1].reward == 1.0, (task.instruction, env.submission)
        assert len(results) == len(plan(dict(task.reward.params)))  # no separate submit turn


async def test_an_other_op_slip_is_never_fixed_and_only_when_asked_for():
    chains = generate_fileops(FileopsConfig(num_tasks=8, seed=6, kinds=["chain"]))
    wrong = 0
    for i, task in enumerate(chains):
        solver = FileopsSolver(task, noise=1.0, seed=i, mistakes=("other_op",), style="marker")
        assert solver.mistake == "other_op" and len(solver.commands) == 3
        results, env = await solve(task, noise=1.0, seed=i, mistakes=("other_op",), style="marker")
        wrong += results[-1].reward == 0.0  # another transformation rarely gives the same answer
    assert wrong >= 5
    assert all(FileopsSolver(t, noise=1.0).mistake != "other_op" for t in chains)
    with pytest.raises(ValueError, match="mistakes"):
        FileopsSolver(chains[0], mistakes=("nap",))
    with pytest.raises(ValueError, match="style"):
        FileopsSolver(chains[0], style="loud")


def test_fanout_reads_a_file_written_three_commands_before():
    from envs.shellstate import state_distances

    tasks = generate_fileops(FileopsConfig(num_tasks=6, seed=7, kinds=["fanout"]))
    for task in tasks:
        commands = plan(dict(task.reward.params))
        assert len(commands) == 4 and state_distances(commands)[-1] == 3, commands


async def test_relay_is_six_to_eight_commands_each_reading_the_last_ones_file():
    """The deep kind (issue 60's turn depths up to 8): five or six transformations in a row,
    solved in real bash with and without a mistake, never past 8 commands even with checks;
    drawn only when named, so the four default kinds' seeded streams are unchanged."""
    from envs.config import FILEOPS_DEEP_KINDS
    from envs.fileops import MAX_COMMANDS
    from envs.shellstate import state_distances

    assert "relay" in FILEOPS_DEEP_KINDS and "relay" not in FileopsConfig().kinds
    tasks = generate_fileops(FileopsConfig(num_tasks=12, seed=9, kinds=["relay"]))
    lengths = set()
    for i, task in enumerate(tasks):
        commands = plan(dict(task.reward.params))
        lengths.add(len(commands))
        # each transformation reads the file the one before wrote; the answer reads the last
        assert state_distances(commands)[1:] == [1] * (len(commands) - 1), commands
        for noise in (0.0, 1.0):
            solver = FileopsSolver(task, noise=noise, seed=i, checks=1.0, style="marker")
            assert len(solver.commands) <= MAX_COMMANDS, solver.commands
            results, env = await solve(task, noise=noise, seed=i, style="marker")
            assert results[-1].reward == 1.0, (task.instruction, env.submission)
    assert lengths == {6, 7}
    # the four kinds' streams do not move because relay exists
    default = generate_fileops(FileopsConfig(num_tasks=30, seed=1))
    assert "relay" not in {t.metadata["kind"] for t in default}
    with pytest.raises(ValueError, match=r"relay"):
        FileopsConfig(kinds=["relays"])


async def test_garbled_commands_fail_or_miss_in_real_bash_and_the_retry_still_solves():
    """`garble`: the kinds of broken command the demo's agent wrote after RL in the simulator.
    Each is run in real bash before the right one; whatever it printed or left behind, the
    episode still reaches the truth, and most garbles fail (bash says so, as the simulator must
    learn to)."""
    from envs.fileops import GARBLES, _garble_once

    tasks = generate_fileops(FileopsConfig(num_tasks=40, seed=8))
    failed = episodes = 0
    for i, task in enumerate(tasks):
        solver = FileopsSolver(task, noise=1.0, seed=i, mistakes=("garble",))
        steps = plan(dict(task.reward.params))
        assert solver.mistake == "garble" and len(solver.commands) == len(steps) + 1
        extra = [c for c in solver.commands if c not in steps]
        assert len(extra) == 1, solver.commands
        results, env = await solve(task, noise=1.0, seed=i, mistakes=("garble",))
        assert results[-1].reward == 1.0, (task.instruction, solver.commands, env.submission)
        garbled = results[solver.commands.index(extra[0])]
        failed += garbled.info.get("exit_code", 0) != 0
        episodes += 1
    assert episodes == 40 and failed >= 24, f"only {failed} of 40 garbled commands failed"
    # `collect.fileops_mistakes` reaches the scripted client's solver.
    from rl.data import ByteTokenizer
    from rl.orchestrator.scripted import ScriptedAgentClient

    client = ScriptedAgentClient(tasks, ByteTokenizer(), noise=1.0, fileops_mistakes=["garble"])
    assert client.fileops_mistakes == ("garble",)
    # Every kind applies somewhere; an append is only ever broken in its name or its target.
    import random

    rng = random.Random(0)
    chain_step, append_step = "head -n 2 input.txt > a.txt", "echo 'x-1' >> log.txt"
    assert all(_garble_once(chain_step, k, rng) not in (None, chain_step) for k in GARBLES)
    allowed = {k for k in GARBLES if _garble_once(append_step, k, rng) is not None}
    assert allowed == {"bad_name", "stutter"}


async def test_warm_start_demonstrations_make_the_mistakes_its_noise_kinds_name():
    """The warm start's `noise_kinds` name its fileops demonstrations' mistakes: the default
    `[other_op]` gives chains with one wrong transformation (RL has something to fix), never
    a recovered mistake; `[typo]` a misspelt command then the right one."""
    from envs.local import LocalShell
    from rl.data import ByteTokenizer, ChatRenderer
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import Backends
    from rl.session.demos import collect_demos
    from rl.train.config import WarmStartConfig

    tasks = generate_fileops(FileopsConfig(num_tasks=8, seed=9, kinds=["chain"]))
    renderer = ChatRenderer(ByteTokenizer())
    backends = Backends(real=lambda task: LocalShell(setup=task.setup))
    orch = OrchestratorConfig(max_context_tokens=4096, max_tokens_per_turn=256)
    for kinds, n_commands in ((["other_op"], 3), (["typo"], 4)):
        ws = WarmStartConfig(num_demos=8, noise=1.0, noise_kinds=kinds)
        demos = await collect_demos(ws, orch, TERMINAL, renderer, backends, tasks, seed=3)
        assert len(demos) == 8
        for d in demos:
            task = next(t for t in tasks if t.id == d.task_id)
            steps = plan(dict(task.reward.params))
            commands = [turn.command for turn in d.turns]
            assert len(commands) == n_commands and commands[-1].endswith(steps[-1]), commands
            if kinds == ["other_op"]:  # one transformation swapped, never fixed
                assert sum(c != s for c, s in zip(commands[:2], steps[:2], strict=True)) == 1, (
                    commands
                )
            else:  # a misspelt command, then the plan
                assert d.reward == 1.0 and len(set(commands) - set(steps)) == 2, commands


async def test_checks_read_back_written_files_without_changing_the_episode_otherwise():
    """`checks`: reads of files the episode wrote, inserted after writes (two at most), on
    their own random stream: the mistakes, the plan's order and the answer are unchanged, and
    the episode still solves its task in real bash."""
    from envs.fileops import CHECK_READS, MAX_CHECKS

    tasks = generate_fileops(FileopsConfig(num_tasks=40, seed=5))
    reads = tuple(r.split(" {f}")[0].rstrip(" <") for r in CHECK_READS) + ("ls",)
    checked = 0
    for task in tasks:
        plain = FileopsSolver(task, noise=0.6, seed=3, style="marker")
        solver = FileopsSolver(task, noise=0.6, seed=3, style="marker", checks=1.0)
        assert solver.mistake == plain.mistake
        extra = list(solver.commands)
        for command in plain.commands:  # the plain episode is a subsequence, the rest checks
            extra = extra[extra.index(command) + 1 :] if command in extra else ["missing"]
        added = [c for c in solver.commands if c not in plain.commands]
        assert extra != ["missing"] and solver.commands[-1] == plain.commands[-1]
        assert 1 <= len(added) <= MAX_CHECKS and len(solver.commands) <= 8, solver.commands
        assert all(c.startswith(reads) for c in added), added
        checked += len(added)
        assert FileopsSolver(task, noise=0.6, seed=3, style="marker", checks=0.0).commands == (
            plain.commands
        )
    assert checked > 40  # two checks in most episodes at checks=1
    for task in tasks[:4]:
        results, env = await solve(task, noise=0.6, seed=3, checks=1.0)
        assert results[-1].reward == 1.0, (task.instruction, env.submission)
    with pytest.raises(ValueError, match=r"checks=1.5 is invalid: a probability in \[0, 1\]"):
        FileopsSolver(tasks[0], checks=1.5)
    from launch.config.schema import CollectConfig
    from rl.data import ByteTokenizer
    from rl.orchestrator.scripted import ScriptedAgentClient

    with pytest.raises(ValueError, match="fileops_checks"):
        CollectConfig(fileops_checks=-0.1)
    assert ScriptedAgentClient(tasks, ByteTokenizer(), fileops_checks=0.5).fileops_checks == 0.5


async def test_the_read_drill_copies_one_file_and_is_drawn_only_when_named():
    """`read`: one file, one command that prints a property of it or all of it; the truth is
    what bash prints, in marker style too. Never among the default kinds."""
    assert "read" not in FileopsConfig().kinds
    cfg = FileopsConfig(num_tasks=24, seed=7, kinds=["read"], words="mixed")
    tasks = generate_fileops(cfg)
    props = {t.reward.params["property"] for t in tasks}
    assert props == {"first_line", "last_line", "line_count", "contents"}
    numbered = [ln for t in tasks for ln in t.reward.params["lines"] if re.search(r"-\d\d$", ln)]
    assert numbered and len(numbered) < sum(len(t.reward.params["lines"]) for t in tasks)
    for task in tasks[:8]:
        solver = FileopsSolver(task, noise=1.0, seed=1, style="marker")
        assert solver.mistake is None and len(solver.commands) == 1
        results, env = await solve(task, noise=1.0, seed=1, style="marker")
        assert results[-1].reward == 1.0, (task.instruction, env.submission)
        assert env.submission.strip() == fileops_truth(dict(task.reward.params))
    # `submit` in a turn of its own carries a whole file (several lines) too.
    whole = next(
        t
        for t in tasks
        if t.reward.params["property"] == "contents" and len(t.reward.params["lines"]) > 1
    )
    results, env = await solve(whole, style="two_step")
    assert results[-1].reward == 1.0, env.submission
    with pytest.raises(ValueError, match=r"kinds.*'fanout', 'relay', 'read', 'lookup'\]"):
        FileopsConfig(kinds=["reads"])


async def test_the_lookup_drill_finds_a_line_by_its_word_and_is_drawn_only_when_named():
    """`lookup`: every line of one file is `word-NN`, with distinct words; the one command
    greps for one word's line, so its number is in the file alone. The truth is bash's
    output, and a wrong number gets no reward."""
    assert "lookup" not in FileopsConfig().kinds
    tasks = generate_fileops(FileopsConfig(num_tasks=16, seed=3, kinds=["lookup"], words="mixed"))
    for task in tasks:
        params = dict(task.reward.params)
        lines = params["lines"]
        assert len(lines) >= 2 and all(re.fullmatch(r"[a-z]+-\d\d", ln) for ln in lines)
        words = [ln.split("-")[0] for ln in lines]
        assert len(set(words)) == len(words) and params["word"] in words
        assert plan(params) == [f"grep '^{params['word']}-' {params['file']}"]
        assert params["word"] not in task.setup.files[params["file"]].split("\n")
    for task in tasks[:6]:
        solver = FileopsSolver(task, noise=1.0, seed=2, style="marker")
        assert solver.mistake is None and len(solver.commands) == 1
        results, env = await solve(task, noise=1.0, seed=2, style="marker")
        assert results[-1].reward == 1.0, (task.instruction, env.submission)
        truth = fileops_truth(dict(task.reward.params))
        assert env.submission.strip() == truth
        assert truth.startswith(f"{task.reward.params['word']}-")
    wrong = truth[:-1] + str((int(truth[-1]) + 1) % 10)
    ctx = None
    assert await fileops_reward(tasks[5], wrong, ctx) == 0.0
    assert await fileops_reward(tasks[5], truth + "\n", ctx) == 1.0
