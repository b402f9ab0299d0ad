"""Workspace mode: the simulator keeps the files itself (`rl.data.sim_format`'s changes
format, `envs.workspace`'s real replays, `SimulatedShell` applying what the model wrote) and
`simloop train-sim` trains on exactly the prompts the shell sends."""

import asyncio
import dataclasses
import random

import pytest

from envs.config import FileopsConfig, SimulatedShellConfig
from envs.fileops import fileops_truth, generate_fileops, plan
from envs.local import LocalShell
from envs.shell import TaskSetup
from envs.simulated import Completion, SimulatedShell
from envs.workspace import replay_workspaces, snapshot, trajectory_workspaces
from rl.data.chat import ChatRenderer
from rl.data.datasets import sim_sft_examples
from rl.data.sim_format import (
    ObservationFormatError,
    absent_names,
    apply_changes,
    format_workspace_reply,
    named_paths,
    normalize_workspace,
    parse_changes,
    parse_observation,
    render_workspace_messages,
    split_changes,
    workspace_changes,
    workspace_description,
)
from rl.data.tokenizer import ByteTokenizer
from rl.data.trajectory import Trajectory, Turn

BYTES = ByteTokenizer()


def random_workspace(rng: random.Random) -> dict[str, str]:
    names = ["a.txt", "b.txt", "d/x.txt", "d/y.txt", "d/e/z.txt", "q/", "r/s/", "n"]
    out = {}
    for name in rng.sample(names, rng.randint(0, len(names))):
        if name.endswith("/"):
            out[name] = ""
            continue
        lines = [rng.choice(["amber", "", " x y", "--- no", "日本", "\\ no"]) for _ in range(3)]
        text = "\n".join(lines[: rng.randint(0, 3)])
        out[name] = text + ("\n" if rng.random() < 0.7 and text else "")
    return normalize_workspace(out)


def test_changes_round_trip_between_any_two_workspaces():
    rng = random.Random(0)
    for _ in range(2000):
        before, after = random_workspace(rng), random_workspace(rng)
        body = workspace_changes(before, after)
        reply = format_workspace_reply("out\n", 3, body)
        text, got = split_changes(reply)
        assert parse_observation(text) == ("out\n", 3)
        assert apply_changes(before, parse_changes(got) if got else []) == after
        assert (got is None) == (before == after)


def test_named_paths_match_whole_words_and_the_files_under_a_named_directory():
    ws = {"input.txt": "x\n", "a.txt": "1\n", "aa.txt": "", "x/a.txt": "", "arch/z.txt": "z\n"}
    assert named_paths(ws, "wc -l < a.txt") == ["a.txt"]
    assert named_paths(ws, "cat a.txt>input.txt") == ["input.txt", "a.txt"]
    assert named_paths(ws, "tail -n 1 aa.txt") == ["aa.txt"]
    assert named_paths(ws, "sed -i s/a/b/ x/a.txt") == ["x/a.txt"]
    assert named_paths(ws, "ls arch | paste -sd, -") == ["arch/z.txt"]
    assert named_paths(ws, "ls") == []
    assert named_paths(ws, "grep a.txtx input.txt2") == []


def test_named_last_moves_the_named_files_before_the_command_and_reads_back_the_same():
    """The files a command names follow the others, each group in the workspace's order; the
    blocks still parse to the same files, and without a command the order is the written
    one (what sim-fileops stages 1-10 were trained on)."""
    ws = {"input.txt": "x\n", "a.txt": "1\n", "b.txt": "2\n", "c.txt": "3\n"}
    text = workspace_description(ws, command="wc -l < a.txt && cat input.txt")
    heads = [ln for ln in text.split("\n") if ln.startswith("--- ")]
    assert heads == ["--- b.txt ---", "--- c.txt ---", "--- input.txt ---", "--- a.txt ---"]
    assert apply_changes({}, parse_changes(text.partition("\n")[2])) == ws
    plain = [ln for ln in workspace_description(ws).split("\n") if ln.startswith("--- ")]
    assert plain == [f"--- {p} ---" for p in ws]
    messages = render_workspace_messages("t", ws, "tail -n 1 b.txt", named_last=True)
    assert messages[0]["content"].endswith("--- b.txt ---\n2\n")
    assert messages[1]["content"] == "tail -n 1 b.txt"


def test_absent_names_are_the_file_shaped_words_the_workspace_lacks():
    ws = {"input.txt": "x\n", "a.txt": "1\n", "arch/z.txt": "z\n", "e/": ""}
    assert absent_names(ws, "sort -r b.txt > c.txt") == ["b.txt", "c.txt"]
    assert absent_names(ws, "tail -n  a.txt > e.txtxtxt") == ["e.txtxtxt"]
    assert absent_names(ws, "cat arch/x_v2.txt arch/z.txt") == ["arch/x_v2.txt"]
    assert absent_names(ws, "cat b.txt; cat b.txt >> aa.txt") == ["b.txt", "aa.txt"]
    # directories, present files and words that are no file name are never listed
    assert absent_names(ws, "ls arch e && cat input.txt | tr a-z A-Z") == []
    text = workspace_description(ws, command="tac b.txt > a.txt", absent_in="tac b.txt > a.txt")
    assert text.endswith("--- a.txt ---\n1\nNot in the working directory: b.txt\n")
    assert workspace_description(ws, absent_in="cat a.txt") == workspace_description(ws)
    messages = render_workspace_messages("t", ws, "wc -l < q.txt", named_absent=True)
    assert messages[0]["content"].endswith("--- e/ ---\nNot in the working directory: q.txt\n")


def test_the_workspace_prompt_is_the_changes_format():
    ws = {"a.txt": "x\n", "n": "no newline", "e/": ""}
    text = workspace_description(ws)
    header, _, body = text.partition("\n")
    assert header == "Files in the working directory:"
    assert apply_changes({}, parse_changes(body)) == ws
    assert workspace_description({}).endswith("(empty)\n")


@pytest.mark.parametrize(
    "body",
    ["stray line\n", "--- /etc/passwd ---\nx\n", "--- ../up.txt ---\n", "--- d/ ---\ncontent\n"],
)
def test_malformed_changes_are_refused(body):
    with pytest.raises(ObservationFormatError):
        parse_changes(body)


async def test_replay_reads_the_real_workspace_after_each_command():
    task = generate_fileops(FileopsConfig(seed=3, num_tasks=12, kinds=("chain",)))[0]
    commands = plan(dict(task.reward.params))
    states = await replay_workspaces(dict(task.setup.files), commands)
    assert len(states) == len(commands) + 1
    assert states[0] == normalize_workspace(task.setup.files)
    # the chain's answer is a property of b.txt, which the replay read back from real bash
    b = states[-1]["b.txt"].splitlines()
    prop = task.reward.params["property"]
    got = {"first_line": b[:1], "last_line": b[-1:], "line_count": [str(len(b))]}[prop]
    assert "".join(got) == fileops_truth(dict(task.reward.params))
    # and a snapshot of a live shell is what the replay recorded at the start
    async with LocalShell(setup=TaskSetup(files=dict(task.setup.files))) as shell:
        assert snapshot(shell.workspace) == states[0]


def fileops_trajectory(task, commands, outputs) -> Trajectory:
    return Trajectory(
        task_id=task.id,
        arm="real",
        env_backend="local",
        status="ok",
        reward=1.0,
        instruction=task.instruction,
        setup_files=dict(task.setup.files),
        prompt=[{"role": "user", "content": task.instruction}],
        turns=[
            Turn(agent_text=f"```bash\n{c}\n```", command=c, observation=o.output, exit_code=code)
            for c, (o, code) in zip(commands, outputs, strict=True)
        ],
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
        task_kind="chain",
    )


async def real_outputs(task, commands):
    out = []
    async with LocalShell(setup=TaskSetup(files=dict(task.setup.files))) as shell:
        for c in commands:
            obs = await shell.run(c, 10.0)
            out.append((obs, obs.exit_code))
    return out


class Teacher:
    """A simulator that answers the k-th prompt with the k-th text, recording the prompts."""

    def __init__(self, replies):
        self.replies, self.prompts = replies, []

    async def complete(self, prompt, **kw):
        self.prompts.append(list(prompt))
        text = self.replies[len(self.prompts) - 1]
        return Completion(text, list(text.encode()), "stop")


async def run_all(shell, commands):
    return [await shell.run(c, 10.0) for c in commands]


@pytest.mark.parametrize(
    ("prompt", "named_last", "named_absent"),
    [
        ({"system_prompt": "", "show_task": False}, False, False),
        ({}, False, False),
        ({}, True, False),
        ({}, True, True),
        ({}, False, True),
    ],
)
def test_training_examples_are_the_prompts_the_workspace_shell_sends(
    prompt, named_last, named_absent
):
    """Teacher forcing: a simulator that answers each prompt with its training target sees,
    turn after turn, exactly the contexts train-sim built, and ends holding the real files
    (with the named files last, or the absent names listed, too, which changes some
    prompts)."""
    tasks = generate_fileops(FileopsConfig(seed=5, num_tasks=6))
    renderer = ChatRenderer(BYTES)
    changed = 0  # examples whose prompt named_last / named_absent changes
    layout = dict(named_last=named_last, named_absent=named_absent)
    for task in tasks[:3]:
        commands = [*plan(dict(task.reward.params)), "cat missing.txt"]
        outputs = asyncio.run(real_outputs(task, commands))
        traj = fileops_trajectory(task, commands, outputs)
        states, failed = trajectory_workspaces([traj])
        assert failed == 0
        built = dict(max_len=4096, workspaces=states, **prompt)
        examples, stats = sim_sft_examples([traj], BYTES, **layout, **built)
        assert stats.examples == len(commands)
        if named_last or named_absent:
            plain, _ = sim_sft_examples([traj], BYTES, **built)
            changed += sum(
                list(a["tokens"]) != list(b["tokens"]) for a, b in zip(examples, plain, strict=True)
            )
        contexts = [list(e["tokens"][e["loss_mask"] == 0]) for e in examples]
        targets = [BYTES.decode(list(e["tokens"][e["loss_mask"] == 1])[:-1]) for e in examples]

        teacher = Teacher(targets)
        cfg = SimulatedShellConfig(
            workspace=True,
            workspace_named_last=named_last,
            workspace_named_absent=named_absent,
            max_context_tokens=4096,
            **prompt,
        )
        shell = SimulatedShell(
            teacher,
            task_instruction=task.instruction,
            setup=task.setup,
            config=cfg,
            renderer=renderer,
        )
        seen = asyncio.run(run_all(shell, commands))
        assert teacher.prompts == contexts
        assert [(o.output, o.exit_code) for o in seen] == [(o.output, code) for o, code in outputs]
        assert not any(o.info["malformed"] for o in seen)
        assert shell.workspace == states(traj)[-1]
    assert changed > 0 if named_last or named_absent else changed == 0


def workspace_shell(replies, files=None, renderer=None, **cfg):
    class Scripted:
        def __init__(self):
            self.prompts = []

        async def complete(self, prompt, **kw):
            self.prompts.append(prompt)
            text = replies.pop(0)
            return Completion(text, list(text.encode()), kw.get("finish", "stop"))

    client = Scripted()
    shell = SimulatedShell(
        client,
        task_instruction="t",
        setup=TaskSetup(files=files or {"in.txt": "b\na\n"}),
        config=SimulatedShellConfig(workspace=True, system_prompt="", show_task=False, **cfg),
        renderer=renderer,
    )
    return shell, client


async def test_the_shell_keeps_what_the_simulator_wrote_and_shows_no_history():
    ok = format_workspace_reply("", 0, "--- out.txt ---\na\nb\n")
    shell, client = workspace_shell([ok, format_workspace_reply("a\n", 0, "")])
    await shell.run("sort in.txt > out.txt", 5.0)
    assert shell.workspace == {"in.txt": "b\na\n", "out.txt": "a\nb\n"}
    assert shell.history[-1][1].info["changes"] == "--- out.txt ---\na\nb\n"
    obs = await shell.run("head -n 1 out.txt", 5.0)
    assert (obs.output, obs.exit_code, obs.info["malformed"]) == ("a\n", 0, False)
    second = client.prompts[1]
    assert "--- out.txt ---\na\nb\n" in second and "sort in.txt" not in second
    assert "history_dropped" not in obs.info


async def test_malformed_or_cut_changes_leave_the_files_as_they_were():
    bad = "<returncode>0</returncode>\n<output>\n\n</output>\n<changes>\nno header\n</changes>"
    cut = "<returncode>0</returncode>\n<output>\nhi\n</output>\n<changes>\n--- x.txt ---\nab"
    shell, _ = workspace_shell([bad, cut])
    obs = await shell.run("echo > x.txt", 5.0)
    assert obs.info["malformed"] and shell.workspace == {"in.txt": "b\na\n"}
    obs = await shell.run("echo hi; echo ab > x.txt", 5.0)
    assert (obs.output, obs.exit_code) == ("hi", 0)
    assert obs.info["malformed"] and shell.workspace == {"in.txt": "b\na\n"}


async def test_a_workspace_over_the_prompt_budget_is_a_clear_error():
    from envs.simulated import SimulatorError

    shell, _ = workspace_shell(
        [],
        files={"big.txt": "x" * 400},
        renderer=ChatRenderer(BYTES),
        max_tokens=64,
        max_context_tokens=256,
    )
    with pytest.raises(SimulatorError, match="workspace prompt has .* tokens"):
        await shell.run("cat big.txt", 5.0)


def test_workspace_mode_config_is_checked():
    with pytest.raises(ValueError, match="workspace"):
        SimulatedShellConfig(workspace="yes")
    with pytest.raises(ValueError, match="workspace"):
        SimulatedShellConfig(
            workspace=True, sessions=True, session_compaction={"mode": "markovian"}
        )


async def test_the_file_just_written_is_shown_last():
    """Newest last: the file a command most likely reads sits right before it."""
    write = format_workspace_reply("", 0, "--- a.txt ---\nnew\n")
    shell, client = workspace_shell([write, write], files={"a.txt": "old\n", "z.txt": "z\n"})
    await shell.run("echo new > a.txt", 5.0)
    assert list(shell.workspace) == ["z.txt", "a.txt"]
    await shell.run("cat a.txt", 5.0)
    assert client.prompts[0].index("a.txt") < client.prompts[0].index("z.txt")
    assert client.prompts[1].index("z.txt") < client.prompts[1].index("a.txt")


def test_lines_added_at_the_end_are_written_alone():
    before = {"log.txt": "a\nb\n", "x": "keep\n"}
    for after_text, body in [
        ("a\nb\nc-12\n", "--- log.txt --- appended\nc-12\n"),
        ("a\nb\nc", "--- log.txt --- appended\nc\n\\ no newline at end of file\n"),
        ("b\nc\n", "--- log.txt ---\nb\nc\n"),  # not an append: the whole file
    ]:
        after = {"x": "keep\n", "log.txt": after_text}
        assert workspace_changes(before, after) == body
        assert apply_changes(before, parse_changes(body)) == after
        assert list(apply_changes(before, parse_changes(body))) == ["x", "log.txt"]
    with pytest.raises(ObservationFormatError, match="appended"):
        parse_changes("--- d/ --- appended\n")


def test_replays_are_cached_by_episode_and_the_cache_never_stops_a_job(
    tmp_path, monkeypatch, capsys
):
    """`ReplayCache`: a second replay of the same episodes runs no bash and returns the same
    states; a changed command or starting file is a new episode; failed replays are not kept;
    a file that is not a cache is reported and the replay runs without it."""
    import envs.workspace as ws

    tasks = generate_fileops(FileopsConfig(seed=4, num_tasks=4, kinds=("chain",)))
    trajs = []
    for task in tasks[:2]:
        commands = plan(dict(task.reward.params))
        trajs.append(fileops_trajectory(task, commands, asyncio.run(real_outputs(task, commands))))
    cache = ws.ReplayCache(tmp_path / "c" / "replays.sqlite")
    first, failed = trajectory_workspaces(trajs, cache=cache)
    assert failed == 0 and cache.hits == 0 and cache.stored == 2
    cache.close()

    ran = []
    real_replay_many = ws.replay_many

    async def counting(episodes, **kw):
        ran.extend(episodes)
        return await real_replay_many(episodes, **kw)

    monkeypatch.setattr(ws, "replay_many", counting)
    again = ws.ReplayCache(tmp_path / "c" / "replays.sqlite")  # another process, later
    second, failed = trajectory_workspaces(trajs, cache=again)
    assert failed == 0 and again.hits == 2 and ran == []
    assert [second(t) for t in trajs] == [first(t) for t in trajs]

    # another command (or another starting file) is another episode: replayed, and added
    changed = dataclasses.replace(trajs[0], setup_files={**trajs[0].setup_files, "x.txt": "x\n"})
    failing = dataclasses.replace(trajs[1], setup_files={"../escape": "no"})
    third, failed = trajectory_workspaces([trajs[0], changed, failing], cache=again)
    assert again.hits == 3 and len(ran) == 2  # trajs[0] from the cache; the other two ran
    assert third(changed)[0]["x.txt"] == "x\n" and third(trajs[0]) == first(trajs[0])
    assert failed == 1 and third(failing) is None
    assert again.stored == 1  # the failed replay is not kept: it runs again next time
    again.close()

    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database, " * 64)
    broken = ws.ReplayCache(junk)
    states, failed = trajectory_workspaces(trajs[:1], cache=broken)
    assert failed == 0 and states(trajs[0]) == first(trajs[0])
    err = capsys.readouterr().err
    assert f"the replay cache {junk} is unusable" in err and "replaying without it" in err
    assert junk.read_bytes() == b"not a database, " * 64  # left alone


def test_the_replay_cache_lives_where_the_environment_says(tmp_path, monkeypatch):
    import envs.workspace as ws

    monkeypatch.setenv(ws.REPLAY_CACHE_ENV, str(tmp_path / "r.sqlite"))
    assert ws.replay_cache_path() == tmp_path / "r.sqlite"
    monkeypatch.delenv(ws.REPLAY_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ws.replay_cache_path() == tmp_path / "xdg" / "simloop" / "workspace-replays.sqlite"
    assert ws.open_replay_cache(False) is None
    # what train-sim and eval-sim call: the second run reads the episode from the cache
    task = generate_fileops(FileopsConfig(seed=6, num_tasks=2, kinds=("append",)))[0]
    commands = plan(dict(task.reward.params))
    traj = fileops_trajectory(task, commands, asyncio.run(real_outputs(task, commands)))
    runs = [ws.cached_workspaces([traj], config=None, use_cache=True) for _ in range(2)]
    assert [(failed, hits) for _, failed, hits in runs] == [(0, 0), (0, 1)]
    assert runs[0][0](traj) == runs[1][0](traj)
    assert (tmp_path / "xdg" / "simloop" / "workspace-replays.sqlite").is_file()
    assert ws.cached_workspaces([traj], config=None, use_cache=False)[2] == 0


def test_observation_weight_marks_the_observation_tokens_and_weights_the_loss():
    """`DatasetConfig.observation_weight`: in a workspace example the observation's tokens
    carry the weight, the changes block and end-of-turn 1, the prompt 0; the SFT loss is the
    weighted mean of the tokens' cross-entropy and `tokens` still counts tokens."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rl.data.datasets import DatasetConfig
    from rl.data.sim_format import format_observation
    from rl.train.losses import sft_loss

    task = generate_fileops(FileopsConfig(seed=5, num_tasks=6, kinds=("chain",)))[0]
    commands = [*plan(dict(task.reward.params)), "cat missing.txt"]
    traj = fileops_trajectory(task, commands, asyncio.run(real_outputs(task, commands)))
    states, _ = trajectory_workspaces([traj])
    plain, _ = sim_sft_examples([traj], BYTES, max_len=4096, workspaces=states)
    heavy, _ = sim_sft_examples(
        [traj], BYTES, max_len=4096, workspaces=states, observation_weight=4
    )
    assert len(plain) == len(heavy) == len(commands)
    for e, h, turn in zip(plain, heavy, traj.turns, strict=True):
        assert (e["tokens"] == h["tokens"]).all() and set(np.unique(e["loss_mask"])) == {0, 1}
        start = int(np.argmax(e["loss_mask"]))
        n_obs = len(BYTES.encode_text(format_observation(turn.observation, turn.exit_code)))
        assert (h["loss_mask"][:start] == 0).all()
        assert (h["loss_mask"][start : start + n_obs] == 4).all()
        assert (h["loss_mask"][start + n_obs :] == 1).all()  # changes (writes), end of turn
    with pytest.raises(ValueError, match="observation_weight"):
        DatasetConfig(observation_weight=0)

    # the loss: weighted mean of -log p over the marked tokens
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 6, 5)), jnp.float32)
    targets = jnp.asarray([[1, 2, 3, 4, 0, 1]], jnp.int32)
    mask = jnp.asarray([[0, 4, 4, 1, 1, 0]], jnp.int32)
    loss, m = sft_loss(logits, {"targets": targets, "loss_mask": mask})
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[0, np.arange(6), np.asarray(targets)[0]]
    w = np.asarray(mask, np.float64)[0]
    assert abs(float(loss) + (w * logp).sum() / w.sum()) < 1e-5
    assert float(m["tokens"]) == 4 and float(m["weight"]) == 10


def test_exit_code_weight_marks_the_return_codes_digits_in_both_modes():
    """`DatasetConfig.exit_code_weight`: the digits of `<returncode>N</returncode>` carry it
    (a misspelt program's `127`, a clean write's `0`), over `observation_weight`; every other
    token keeps the weight it had, in workspace and in history mode alike."""
    import numpy as np

    from rl.data.datasets import DatasetConfig

    task = generate_fileops(FileopsConfig(seed=5, num_tasks=6, kinds=("chain",)))[0]
    first, *rest = plan(dict(task.reward.params))
    commands = [f"sotr {first.partition(' ')[2]}", first, *rest]  # a misspelt program first
    traj = fileops_trajectory(task, commands, asyncio.run(real_outputs(task, commands)))
    assert traj.turns[0].exit_code == 127 and traj.turns[1].exit_code == 0
    states, _ = trajectory_workspaces([traj])
    for mode in ({"workspaces": states, "observation_weight": 3}, {}):
        plain, _ = sim_sft_examples([traj], BYTES, max_len=4096, **mode)
        heavy, _ = sim_sft_examples([traj], BYTES, max_len=4096, exit_code_weight=9, **mode)
        assert len(plain) == len(heavy) == len(commands)
        for e, h, turn in zip(plain, heavy, traj.turns, strict=True):
            start = int(np.argmax(e["loss_mask"])) + len("<returncode>")
            digits = np.arange(start, start + len(str(turn.exit_code)))
            assert bytes(e["tokens"][digits].tolist()).decode() == str(turn.exit_code)
            assert (h["loss_mask"][digits] == 9).all()
            others = np.setdiff1d(np.arange(len(e["loss_mask"])), digits)
            assert (h["loss_mask"][others] == e["loss_mask"][others]).all()
    with pytest.raises(ValueError, match="exit_code_weight"):
        DatasetConfig(exit_code_weight=0)


def test_a_simulator_is_served_only_with_the_prompt_layout_it_was_trained_on(tmp_path):
    """train-sim records the layout beside the weights; a client config with another layout is
    refused before any server starts, naming the flags to serve them with; weights without
    a record (older ones) are served as configured."""
    from launch.config import load_config
    from launch.config.schema import SimloopConfig
    from launch.deploy.local import check_prompt_layout, role_clients
    from launch.errors import JobError
    from rl.data.sim_format import PROMPT_LAYOUT_FILE, layout_mismatches, prompt_layout_record

    trained = SimulatedShellConfig(
        workspace=True, workspace_named_last=True, workspace_named_absent=True
    )
    (tmp_path / PROMPT_LAYOUT_FILE).write_text(prompt_layout_record(trained.prompt_layout()))
    assert layout_mismatches(tmp_path, trained.prompt_layout()) == []
    flags = ["--simulator.weights", str(tmp_path), "--env.shell.simulated.workspace", "true"]
    flags += ["--env.shell.simulated.workspace_named_last", "true"]
    check_prompt_layout(load_config(SimloopConfig, None, [*flags, _ABSENT, "true"]))
    with pytest.raises(JobError) as e:
        check_prompt_layout(load_config(SimloopConfig, None, flags))
    assert "workspace_named_absent trained true, served false" in str(e.value)
    assert f"({_ABSENT} true)" in str(e.value) and PROMPT_LAYOUT_FILE in str(e.value)

    async def clients():  # every job's simulator clients come from here: refused first
        async with role_clients(load_config(SimloopConfig, None, flags), tmp_path, ["simulator"],
                                who="test"):  # fmt: skip
            pytest.fail("a server started for a simulator served with another layout")

    with pytest.raises(JobError, match="another prompt layout"):
        asyncio.run(clients())
    (tmp_path / PROMPT_LAYOUT_FILE).unlink()
    check_prompt_layout(load_config(SimloopConfig, None, flags))


_ABSENT = "--env.shell.simulated.workspace_named_absent"
