"""The orchestrator against an in-memory agent and real local shells: token-in/token-out,
statuses and reasons, groups, limits, admission with a staleness bound, storage."""

import asyncio
import contextlib
import json

import pytest

from envs.config import LocalShellConfig, SimulatedShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.simulated import Completion, SimulatedShell
from envs.textops import generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.sim_format import format_observation
from rl.data.trajectory import read_jsonl, validate
from rl.orchestrator.admission import AdmissionController
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.runner import Backends, RolloutRunner
from rl.orchestrator.storage import TrajectoryWriter
from tests.fakes import FakeAgentClient

RENDERER = ChatRenderer(ByteTokenizer())
TERMINAL = TerminalConfig(max_turns=4, command_timeout_s=10)


def _local(task):
    return LocalShell(LocalShellConfig(), setup=task.setup)


def _tasks(n=4, seed=0):
    return generate_textops(TextopsConfig(num_tasks=n, seed=seed))


def _runner(cfg, client, **backends):
    return RolloutRunner(cfg, TERMINAL, RENDERER, Backends(**backends), client=client)


async def test_real_arm_solves_textops_and_keeps_tokens_verbatim(tmp_path):
    tasks = _tasks(4)
    client = FakeAgentClient(tasks, version=3)
    writer = TrajectoryWriter(tmp_path, shard_size=3)
    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=2),
        TERMINAL,
        RENDERER,
        Backends(real=_local),
        client=client,
        sinks=(writer.add,),
    )
    trajs = await runner.run(tasks)
    writer.close()
    assert len(trajs) == 8
    for t in trajs:
        validate(t)
        assert t.status == "ok" and t.reward == 1.0, (t.status, t.reason, t.turns)
        assert set(v for v in t.policy_version if v is not None) == {3}
    # Token-in/token-out: every reply sits in the trajectory exactly as the server sent it,
    # and the prompt the server saw is exactly the trajectory up to that reply.
    served = {tuple(p): g for p, g in client.replies}
    for t in trajs:
        for turn in t.turns:
            start, end = turn.token_span
            assert served[tuple(t.token_ids[:start])] == t.token_ids[start:end]
            assert all(m == 1 for m in t.loss_mask[start:end])
    assert sum(m for t in trajs for m in t.loss_mask) == sum(len(g) for _, g in client.replies)
    stored = [x for p in sorted((tmp_path / "trajectories").glob("*.jsonl")) for x in read_jsonl(p)]
    assert len(stored) == 8 and len(list((tmp_path / "trajectories").glob("*.array_record"))) == 3
    m = runner.metrics.summary()
    assert m["status"] == {"ok": 8} and m["success_rate"] == 1.0 and m["active_per_turn"][0] == 8


async def until(event: asyncio.Event, job: asyncio.Task, timeout_s: float = 60.0) -> None:
    """Wait for `event`; fail at once (with its error) if `job` ends first. The timeout only
    guards against a hang: nothing here races a clock."""
    waiter = asyncio.create_task(event.wait())
    await asyncio.wait({waiter, job}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not event.is_set():
        raise AssertionError(f"{job.get_name()} ended first: {job.result() if job.done() else job}")


async def test_trajectories_come_back_in_task_order_whatever_finishes_first():
    tasks = generate_textops(TextopsConfig(num_tasks=4, seed=0, from_file_prob=0.0))
    gates = {t.id: asyncio.Event() for t in tasks}  # the test opens them, last task first

    class Gated(FakeAgentClient):
        """Every reply for a task waits until the test opens that task's gate."""

        async def complete(self, prompt, **kw):
            text = self.tok.decode(prompt)
            task = next(t for t in tasks if t.instruction in text)
            await gates[task.id].wait()
            return await super().complete(prompt, **kw)

    finished = []
    delivered = {t.id: asyncio.Event() for t in tasks}

    def sink(traj):
        finished.append(traj.task_id)
        if finished.count(traj.task_id) == 2:
            delivered[traj.task_id].set()

    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=2),
        TERMINAL,
        RENDERER,
        Backends(real=_local),
        client=Gated(tasks),
        sinks=(sink,),
    )
    job = asyncio.create_task(runner.run(tasks), name="rollout")
    # One group at a time, the last task's first: each gate opens once the group before it
    # was delivered, so the finishing order is the reverse of the task order on any machine.
    for task in reversed(tasks):
        gates[task.id].set()
        await until(delivered[task.id], job)
    trajs = await job
    assert finished == [t.id for t in reversed(tasks) for _ in range(2)]
    assert [t.task_id for t in trajs] == [t.id for t in tasks for _ in range(2)]


async def test_failed_sibling_masks_the_group_with_a_reason():
    tasks = _tasks(2)
    client = FakeAgentClient(tasks, fail_task=tasks[0].id)
    trajs = await _runner(OrchestratorConfig(arm="real", group_size=2), client, real=_local).run(
        tasks
    )
    bad = [t for t in trajs if t.task_id == tasks[0].id]
    good = [t for t in trajs if t.task_id == tasks[1].id]
    for t in bad:
        validate(t)
        assert t.status == "error" and "503" in t.reason
        assert t.exclusion.kind == "masked_group" and "2 sibling(s) failed" in t.exclusion.reason
    assert all(t.status == "ok" and t.exclusion is None for t in good)


async def test_drop_episode_policy_marks_only_the_failed_one():
    tasks = _tasks(1)
    client = FakeAgentClient(tasks, fail_task=tasks[0].id)
    cfg = OrchestratorConfig(arm="real", group_size=2, failed_sibling="drop_episode")
    trajs = await _runner(cfg, client, real=_local).run(tasks)
    assert all(t.exclusion.kind == "dropped" and "503" in t.exclusion.reason for t in trajs)


async def test_the_runner_hands_every_trajectory_to_each_sink_in_order():
    tasks = _tasks(2)
    calls = []
    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=2),
        TERMINAL,
        RENDERER,
        Backends(real=_local),
        client=FakeAgentClient(tasks),
        sinks=(lambda t: calls.append(("a", id(t))), lambda t: calls.append(("b", id(t)))),
    )
    trajs = await runner.run(tasks)
    assert len(trajs) == 4 and sorted(calls) == sorted((k, id(t)) for t in trajs for k in "ab")
    assert [k for k, _ in calls] == ["a", "b"] * 4  # each trajectory to `a`, then to `b`


async def test_wall_clock_guard_ends_in_timeout():
    tasks = _tasks(1)
    client = FakeAgentClient(tasks, delay_s=5.0)
    cfg = OrchestratorConfig(arm="real", episode_timeout_s=0.5)
    (t,) = await _runner(cfg, client, real=_local).run(tasks)
    validate(t)
    assert t.status == "timeout" and "wall-clock" in t.reason and t.reward is None


async def test_full_context_ends_truncated_and_cut_replies_are_closed():
    tasks = _tasks(1)
    client = FakeAgentClient(tasks, never_stop=True)
    cfg = OrchestratorConfig(arm="real", max_tokens_per_turn=64, max_context_tokens=1200)
    (t,) = await _runner(cfg, client, real=_local).run(tasks)
    validate(t)
    assert t.status == "truncated" and t.reason
    assert all("agent_cap_hit" in turn.flags for turn in t.turns)
    assert t.turns and len(t.token_ids) <= 1200 + 1  # + the <|im_end|> closing a cut reply


class EchoSimulator:
    """A simulator that always answers `rc 0` with the command itself as output."""

    async def complete(self, prompt, **_):
        text = ByteTokenizer().decode(prompt) if isinstance(prompt, list) else prompt
        command = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        return Completion(format_observation(command.strip()[-20:], 0), [], "stop")


def _simulated(task):
    cfg = SimulatedShellConfig(max_tokens=64)
    return SimulatedShell(
        EchoSimulator(),
        task_instruction=task.instruction,
        setup=task.setup,
        config=cfg,
        renderer=RENDERER,
    )


async def test_closed_loop_and_mixed_arms_record_backend_and_validate():
    tasks = _tasks(6)
    client = FakeAgentClient(tasks)
    trajs = await _runner(OrchestratorConfig(arm="closed_loop"), client, simulated=_simulated).run(
        tasks
    )
    assert {t.env_backend for t in trajs} == {"simulated"} and {t.arm for t in trajs} == {
        "closed_loop"
    }
    for t in trajs:
        validate(t)
    cfg = OrchestratorConfig(arm="mixed", mixed_real_fraction=0.5, seed=1)
    mixed = await _runner(cfg, client, real=_local, simulated=_simulated).run(tasks)
    assert {t.env_backend for t in mixed} == {"local", "simulated"}


async def test_replay_arm_pairs_real_and_simulated_observations():
    tasks = _tasks(2)
    real = await _runner(OrchestratorConfig(arm="real"), FakeAgentClient(tasks), real=_local).run(
        tasks
    )
    runner = RolloutRunner(
        OrchestratorConfig(arm="replay"), TERMINAL, RENDERER, Backends(simulated=_simulated)
    )
    replays = await runner.run(tasks, replay=real)
    assert len(replays) == 2
    for t in replays:
        validate(t)
        assert t.arm == "replay" and t.status == "ok" and 0 <= t.reward <= 1
        for turn in t.turns:
            assert turn.observation is not None and turn.sim_observation is not None
    assert json.dumps(replays[0].to_dict())  # JSON-serialisable


async def test_admission_bounds_staleness():
    adm = AdmissionController(batch_size=2, max_staleness=0)
    assert [await adm.admit(), await adm.admit()] == [0, 0]
    third = asyncio.create_task(adm.admit(), name="third")
    await asyncio.sleep(0.05)
    assert not third.done()  # S=0: the next batch waits for the trainer
    await adm.set_version(1)
    assert await asyncio.wait_for(third, 1) == 1
    loose = AdmissionController(batch_size=2, max_staleness=1)
    for _ in range(4):
        await asyncio.wait_for(loose.admit(), 1)  # two batches ahead of version 0
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(loose.admit(), 0.05)
    with pytest.raises(ValueError, match="backwards"):
        await loose.set_version(-1)


async def test_a_shell_that_raises_mid_turn_keeps_the_reply_in_its_turn():
    """The reply was sampled before the shell broke: its tokens stay inside a turn, so the
    trajectory validates (and a writer stores it) instead of failing the whole rollout."""
    tasks = _tasks(2)

    class Breaks(LocalShell):
        async def run(self, command, timeout_s):
            raise ValueError("the shell broke")

    writer_got = []

    def sink(traj):
        validate(traj)  # what TrajectoryWriter.add does first
        writer_got.append(traj)

    runner = RolloutRunner(
        OrchestratorConfig(arm="real", group_size=2),
        TERMINAL,
        RENDERER,
        Backends(real=lambda task: Breaks(LocalShellConfig(), setup=task.setup)),
        client=FakeAgentClient(tasks),
        sinks=(sink,),
    )
    trajs = await runner.run(tasks)
    assert len(writer_got) == len(trajs) == 4
    for t in trajs:
        assert t.status == "error" and "the shell broke" in t.reason
        (turn,) = t.turns
        start, end = turn.token_span
        assert sum(t.loss_mask) == end - start > 0 and turn.agent_text
        assert turn.command is None and turn.observation is None


async def test_a_nul_byte_in_the_command_is_a_format_error_not_a_crash():
    tasks = _tasks(1)

    class Nul(FakeAgentClient):
        async def complete(self, prompt, **kw):
            out = await super().complete(prompt, **kw)
            ids = self.tok.encode("```bash\necho a\0b\n```") + [self.tok.eos_id]
            out.text, out.token_ids, out.logprobs = (
                self.tok.decode(ids[:-1]),
                ids,
                [-0.5] * len(ids),
            )
            out.token_versions = [self.version] * len(ids)
            return out

    (t,) = await _runner(OrchestratorConfig(arm="real"), Nul(tasks), real=_local).run(tasks)
    validate(t)
    assert t.status == "truncated" and all("format_error" in u.flags for u in t.turns)
    assert "NUL byte" in t.turns[0].env_messages[0]["content"]


async def test_shutdown_cancellation_yields_aborted_trajectories():
    tasks = _tasks(2)
    asked, never = asyncio.Event(), asyncio.Event()

    class Hangs(FakeAgentClient):
        """Signals once both episodes are waiting for a reply, and never replies."""

        async def complete(self, prompt, **kw):
            self.calls += 1
            if self.calls == len(tasks):
                asked.set()
            await never.wait()

    got = []
    runner = RolloutRunner(
        OrchestratorConfig(arm="real"),
        TERMINAL,
        RENDERER,
        Backends(real=_local),
        client=Hangs(tasks),
        sinks=(got.append,),
    )
    job = asyncio.create_task(runner.run(tasks), name="rollout")
    await until(asked, job)  # both shells are up and both episodes are mid-request
    job.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await job  # run() delivers the aborted trajectories before it re-raises
    assert len(got) == 2 and all(t.status == "aborted" and t.reason for t in got)
    for t in got:
        validate(t)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="arm='robot'"):
        OrchestratorConfig(arm="robot")
    with pytest.raises(ValueError, match="max_tokens_per_turn"):
        OrchestratorConfig(max_tokens_per_turn=5000, max_context_tokens=4096)
    with pytest.raises(ValueError, match="needs the simulated shell"):
        RolloutRunner(
            OrchestratorConfig(arm="closed_loop"),
            TERMINAL,
            RENDERER,
            Backends(),
            client=FakeAgentClient([]),
        )
