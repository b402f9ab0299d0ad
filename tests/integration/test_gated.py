"""The gated arm end to end in the orchestrator, on textops in real shells: a simulator that is
exact on one operation (it runs the command in real bash) and wrong on another. Real episodes
are shadow-replayed against it; after one batch the exact operation's groups go to the
simulator (but for the minimum real share), the wrong one's stay in the real shell, and a new
simulator version closes every gate until it has been measured itself."""

from __future__ import annotations

import asyncio

import pytest

from envs.config import LocalShellConfig, SimulatedShellConfig, TerminalConfig, TextopsConfig
from envs.local import LocalShell
from envs.simulated import Completion, SimulatedShell
from envs.textops import generate_textops
from rl.data import ByteTokenizer, ChatRenderer
from rl.data.sim_format import format_observation
from rl.orchestrator.config import GateConfig, OrchestratorConfig
from rl.orchestrator.episode import run_replay_episode
from rl.orchestrator.gate import FidelityRouter, ShadowReplayer
from rl.orchestrator.runner import Backends, RolloutRunner
from tests.fakes import FakeAgentClient

pytestmark = pytest.mark.slow
RENDERER = ChatRenderer(ByteTokenizer())
TERMINAL = TerminalConfig(max_turns=4, command_timeout_s=10)


class HalfRightSimulator:
    """Answers a command as real bash does on the task's files, except on `wrong` tasks,
    where every observation is a plausible but wrong word."""

    def __init__(self, task, wrong: set[str]):
        self.task, self.wrong = task, wrong

    async def complete(self, prompt, **_):
        text = ByteTokenizer().decode(prompt) if isinstance(prompt, list) else prompt
        command = text.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]
        if self.task.kind in self.wrong:
            return Completion(format_observation("olleh\n", 0), [], "stop")
        async with LocalShell(LocalShellConfig(), setup=self.task.setup) as shell:
            obs = await shell.run(command, timeout_s=10)
        return Completion(format_observation(obs.output, obs.exit_code), [], "stop")


def _local(task):
    return LocalShell(LocalShellConfig(), setup=task.setup)


def _simulated(task):
    return SimulatedShell(
        HalfRightSimulator(task, {"reverse"}),
        task_instruction=task.instruction,
        setup=task.setup,
        config=SimulatedShellConfig(max_tokens=64),
        renderer=RENDERER,
    )


async def test_the_exact_operation_goes_to_the_simulator_and_the_wrong_one_stays_real():
    tasks = generate_textops(TextopsConfig(num_tasks=8, seed=3, ops=["upper", "reverse"]))
    kinds = {t.id: t.kind for t in tasks}
    n_upper = sum(k == "upper" for k in kinds.values())
    assert set(kinds.values()) == {"upper", "reverse"} and n_upper <= 8
    gate = GateConfig(threshold=0.75, confidence=0.9, real_min=0.25, remeasure=8)
    router = FidelityRouter(gate, sim_version=1)

    def replay(real, task):
        return run_replay_episode(real, _simulated, task, RENDERER, group_id="shadow")

    shadow = ShadowReplayer(router, replay, concurrency=4, remeasure=8)
    cfg = OrchestratorConfig(arm="gated", group_size=2, batch_size=16, gate=gate)
    runner = RolloutRunner(
        cfg,
        TERMINAL,
        RENDERER,
        Backends(real=_local, simulated=_simulated),
        client=FakeAgentClient(tasks),
        router=router,
        shadow=shadow,
    )

    first = await runner.run(tasks)  # nothing measured yet: every group in the real shell
    assert {t.arm for t in first} == {"real"} and all(t.status == "ok" for t in first)
    await shadow.drain(120.0)
    assert shadow.stats()["replayed"] == len(first) and shadow.stats()["failed"] == 0
    upper, reverse = router.estimate("upper", 0), router.estimate("reverse", 0)
    assert upper.fidelity == 1.0 and upper.lower >= 0.75, upper
    assert reverse.fidelity == 0.0 and reverse.lower == 0.0, reverse

    second = await runner.run(tasks)
    arms = {}
    for t in second:
        arms.setdefault(kinds[t.task_id], []).append(t.arm)
        assert t.gate_unit == kinds[t.task_id]
    assert set(arms["reverse"]) == {"real"}
    # upper's gate opened after the first batch: of the groups since, the j-th goes real while
    # fewer than floor(0.25 j) have (the 4th, the 8th), the rest to the simulator.
    owed = n_upper // 4
    assert arms["upper"].count("real") == 2 * owed  # two episodes a group
    assert arms["upper"].count("closed_loop") == 2 * (n_upper - owed)
    # The simulated upper episodes still succeed: the simulator is exact there.
    assert all(t.reward == 1.0 for t in second if t.arm == "closed_loop")
    await shadow.drain(120.0)

    # A new simulator version: every gate closes until that version has been measured; the
    # replayer's remeasure replays the latest real episodes against it.
    router.set_sim_version(2)
    assert router.route(tasks[0], 0) == "real"
    assert shadow.remeasure() == 8 + 8  # the last 8 real episodes of each unit
    await shadow.drain(120.0)
    assert router.estimate("upper", 0).lower >= 0.75 and router.estimate("reverse", 0).lower == 0
    summary = router.summary()["units"]
    assert summary["reverse"]["sim_share"] == 0.0
    assert summary["upper"]["routed_sim"] == n_upper - owed
    await shadow.close()


async def test_gated_groups_take_whole_batches_under_synchronous_rl():
    # Every group is admitted whole: taken one episode at a time, many groups' first episodes
    # could fill a version's batch that none of them completes (a deadlock, found this way).
    from rl.orchestrator.buffer import RolloutBuffer

    tasks = generate_textops(TextopsConfig(num_tasks=6, seed=4, ops=["upper", "reverse"]))
    gate = GateConfig(threshold=0.75, real_min=0.25)
    router = FidelityRouter(gate)
    cfg = OrchestratorConfig(arm="gated", group_size=2, batch_size=4, max_staleness=0, gate=gate)
    queue: asyncio.Queue = asyncio.Queue()
    runner = RolloutRunner(
        cfg,
        TERMINAL,
        RENDERER,
        Backends(real=_local, simulated=_simulated),
        client=FakeAgentClient(tasks),
        router=router,
        sinks=(queue.put_nowait,),
    )
    buffer = RolloutBuffer(runner, tasks, queue=queue, steps=3, seed=0, batch_timeout_s=60.0)
    await buffer.start(1)
    try:
        for version in (1, 2, 3):
            batch = await buffer.next_batch()
            assert len(batch) == 4 and {t.admitted_version for t in batch} == {version}
            assert len({t.group_id for t in batch}) == 2  # two whole groups
            await buffer.set_version(version + 1)
    finally:
        await buffer.close()
    assert router.snapshot(3)["units"]  # the router saw every group it routed
