"""rl/train/loop.py: `rl_loop` publishing version v in the background while the next step runs
(`overlap_publish`), against a publisher that takes a while to load: the order of events, the
version the source hears and when, staleness measured against the trainer's own version (and
none at all under synchronous RL through the real rollout buffer), a failed publish surfacing
and a failing loop cancelling its publish, the same weights exported as without the overlap,
and the export kept in line when there are several processes."""

from __future__ import annotations

import asyncio
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.model.config import tiny
from rl.model.publish import PublishReport
from rl.train.checkpoint import Checkpointer, export_path
from rl.train.config import CheckpointConfig, OptimConfig, PolicyLossConfig
from rl.train.loop import rl_loop
from rl.train.rollouts import InMemoryEpisodeSource
from rl.train.trainer import Trainer
from tests.unit.test_train_rollouts import make_traj

VALID = 261
LOAD_S = 0.3
"""How long the fake servers take to load a version: longer than a tiny step's data wait."""
HOLD_S = 30.0


@pytest.fixture(scope="module")
def policy():
    trainer = Trainer(
        tiny(),
        OptimConfig(lr=1e-3, warmup_steps=0),
        total_steps=10,
        loss="policy",
        loss_cfg=PolicyLossConfig(),
        valid_vocab=VALID,
        seed=0,
    )
    return trainer, jax.device_get(trainer.state)


def fresh(policy) -> Trainer:
    """The module's trainer, put back to its initial state (every test starts there)."""
    trainer, initial = policy
    trainer.state = jax.tree.map(
        lambda x, s: jax.device_put(np.array(x), s), initial, trainer.state_shardings
    )
    return trainer


class Steps:
    """The trainer, recording ("step", k) in `events` as its k-th step of the run starts (from
    the loop's worker thread); `started[k]` and `finished[k]` are set once it has."""

    def __init__(self, trainer: Trainer, events: list):
        self._trainer, self._events, self._n = trainer, events, 0
        self.started = {k: threading.Event() for k in range(1, 11)}
        self.finished = {k: threading.Event() for k in range(1, 11)}

    def __getattr__(self, name):
        return getattr(self._trainer, name)

    def step(self, batch):
        self._n += 1
        k = self._n
        self._events.append(("step", k))
        self.started[k].set()
        out = jax.block_until_ready(self._trainer.step(batch))
        self.finished[k].set()
        return out


class SlowPublisher:
    """Servers that take `LOAD_S` to load a version: ("publish", v) when asked, ("served", v)
    when `publish` returns. `fail` maps a version to the exception its publish raises (after
    the load, or after `hold[v]`, a threading.Event, is set)."""

    def __init__(self, events: list, fail: dict | None = None, hold: dict | None = None):
        self.events, self.fail, self.hold = events, fail or {}, hold or {}
        self.published: list[int] = []

    async def publish(self, path: str, version: int) -> PublishReport:
        self.events.append(("publish", version))
        if version in self.hold:  # at most HOLD_S: a loop that never gets there fails a test
            for _ in range(int(HOLD_S / 0.01)):
                if self.hold[version].is_set():
                    break
                await asyncio.sleep(0.01)
        await asyncio.sleep(LOAD_S)
        if version in self.fail:
            raise self.fail[version]
        self.published.append(version)
        self.events.append(("served", version))
        return PublishReport(version, path, load_s=LOAD_S, first_token_s=LOAD_S)


class Source(InMemoryEpisodeSource):
    """Four episodes per batch whose tokens carry the version the source last heard of (what
    the servers serve), recording ("set_version", v) in `events`."""

    def __init__(self, events: list):
        super().__init__(
            lambda v: [
                make_traj(reward=float(i % 2), group="g", gens=((4, v), (3, v))) for i in range(4)
            ]
        )
        self.events = events

    async def set_version(self, version: int) -> None:
        self.events.append(("set_version", version))
        await super().set_version(version)


async def run(trainer, source, publisher, tmp_path, *, steps=3, overlap=True, **kw):
    await source.set_version(1)  # as RLSession starts: version 1 is served
    return await rl_loop(
        trainer,
        source,
        publisher,
        run_dir=tmp_path,
        steps=steps,
        rows=4,
        seq_len=16,
        loss_cfg=PolicyLossConfig(),
        pad_id=0,
        overlap_publish=overlap,
        progress=False,
        **kw,
    )


def at(events: list, event: tuple) -> int:
    return events.index(event)


@pytest.mark.parametrize("overlap", [True, False])
async def test_the_next_step_runs_while_a_version_loads_and_the_source_hears_it_once_served(
    policy, tmp_path, overlap
):
    events: list = []
    trainer = Steps(fresh(policy), events)
    source = Source(events)
    # With the overlap, version k + 1 finishes loading only once step k + 1 has started (or
    # after HOLD_S): the order then shows whether the loop went on while it loaded, however
    # long a checkpoint takes. Without, nothing is held (the loop waits for every load).
    hold = {v: trainer.started[v] for v in (2, 3)} if overlap else {}
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=True, keep=5)) as ckpt:
        summary = await run(
            trainer,
            source,
            SlowPublisher(events, hold=hold),
            tmp_path,
            steps=3,
            overlap=overlap,
            ckpt=ckpt,
            ckpt_every=1,
        )
        events.append(("returned",))
        assert ckpt.all_steps() == [1, 2, 3]  # saved alongside the exports in flight
    # Step k + 1 starts before version k + 1 (made by step k) is served with the overlap, and
    # after it without.
    for k in (1, 2):
        overlapped = at(events, ("step", k + 1)) < at(events, ("served", k + 1))
        assert overlapped == overlap, events
    for v in (2, 3, 4):
        # The source hears of v only once the servers serve it, and in order.
        assert at(events, ("served", v)) < at(events, ("set_version", v)), events
        if v > 2:  # at most one version in flight: v is sent once v - 1 is served
            assert at(events, ("served", v - 1)) < at(events, ("publish", v)), events
    # The last version is served and announced before rl_loop returns.
    assert events[-3:] == [("served", 4), ("set_version", 4), ("returned",)], events
    assert source.versions_seen == [0, 1, 2, 3, 4]
    # Every step's record is written once its version is served, with its own timings.
    hist = summary["history"]
    assert [h["step"] for h in hist] == [1, 2, 3] and [h["version"] for h in hist] == [2, 3, 4]
    for h in hist:
        assert h["publish_load_s"] == LOAD_S and h["export_s"] > 0
        assert h["publish_total_s"] >= h["export_s"] + LOAD_S  # the export, then the load
        assert h["publish_wait_s"] >= 0
    # Without the overlap the loop waited for every load (with it, the steps here are too short
    # against a load for the time saved to be measured; bench/train_step.py measures it).
    assert summary["publish_total_s"] >= 3 * LOAD_S
    if not overlap:
        assert summary["publish_s"] >= 3 * LOAD_S
    assert summary["overlap_publish"] is overlap


@pytest.mark.parametrize("overlap", [True, False])
async def test_staleness_is_measured_against_the_trainers_own_version(policy, tmp_path, overlap):
    """A batch drawn while version v + 1 is still loading carries tokens of v: the trainer, at
    v + 1, trains them 1 version stale, and the record says so."""
    events: list = []
    summary = await run(
        fresh(policy), Source(events), SlowPublisher(events), tmp_path, steps=3, overlap=overlap
    )
    stale = [h["staleness_max"] for h in summary["history"]]
    assert stale == ([0, 1, 1] if overlap else [0, 0, 0])


async def test_unpublished_versions_reach_the_source_in_order(policy, tmp_path):
    """publish_every=2: v2 and v4 are not published; v4 is announced after v3 is served."""
    events: list = []
    source, publisher = Source(events), SlowPublisher(events)
    await run(fresh(policy), source, publisher, tmp_path, steps=4, publish_every=2)
    assert publisher.published == [3, 5]
    assert source.versions_seen == [0, 1, 2, 3, 4, 5]
    assert at(events, ("served", 3)) < at(events, ("set_version", 3))
    assert at(events, ("served", 5)) < at(events, ("set_version", 5))


def _loop_tasks() -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("rl-")]


async def test_a_failed_background_publish_stops_the_loop_with_its_error(policy, tmp_path):
    """Version 3's load fails while step 3 runs: rl_loop raises the publisher's own exception
    at its next wait (before sending version 4) and step 4 never runs."""
    events: list = []
    trainer = Steps(fresh(policy), events)
    publisher = SlowPublisher(
        events,
        fail={3: OSError("the server refused version 3")},
        hold={3: trainer.started[3]},
    )
    with pytest.raises(OSError, match="refused version 3"):
        await run(trainer, Source(events), publisher, tmp_path, steps=5)
    assert trainer.step_count == 3 and ("step", 4) not in events
    assert publisher.published == [2] and ("publish", 4) not in events
    assert _loop_tasks() == []


async def test_a_failed_publish_ends_a_data_wait_that_hangs_on_it(policy, tmp_path):
    """Under synchronous RL the next batch waits for the new version to be served; when its
    publish fails, the data wait ends at once with the publisher's error, not a timeout."""
    events: list = []

    class Waiting(Source):
        calls = 0

        async def next_batch(self):
            self.calls += 1
            while self.version < self.calls:  # batch k needs version k served
                await asyncio.sleep(0.01)
            return await super().next_batch()

    publisher = SlowPublisher(events, fail={2: OSError("the server refused version 2")})
    with pytest.raises(OSError, match="refused version 2"):
        await asyncio.wait_for(
            run(fresh(policy), Waiting(events), publisher, tmp_path, steps=3), timeout=60
        )
    assert _loop_tasks() == []


async def test_a_failing_step_cancels_the_publish_in_flight(policy, tmp_path):
    """The loop fails while version 2 loads (the next batch cannot be had): rl_loop raises
    that failure, and the publish it leaves is cancelled, not left running."""
    events: list = []

    class Broken(Source):
        calls = 0

        async def next_batch(self):
            self.calls += 1
            if self.calls == 2:
                while ("publish", 2) not in events:
                    await asyncio.sleep(0.01)
                raise RuntimeError("rollouts failed")
            return await super().next_batch()

    publisher = SlowPublisher(events)
    with pytest.raises(RuntimeError, match="rollouts failed"):
        await run(fresh(policy), Broken(events), publisher, tmp_path, steps=3)
    assert ("publish", 2) in events and ("served", 2) not in events
    assert _loop_tasks() == []


async def test_the_overlapped_export_writes_each_versions_own_weights(
    policy, tmp_path, monkeypatch
):
    """Each exported version holds exactly the params of the step that made it, as without the
    overlap, even when its export only starts writing after the next step has run (that step
    donates the state: its buffers are reused for the next one). No checkpoints here: on CPU,
    saving one leaves host views of the state, and XLA then copies instead of donating."""
    from rl.model import params_io

    weights = {}
    for overlap in (False, True):
        events: list = []
        trainer = Steps(fresh(policy), events)
        if overlap:

            def late_save(model, path, *, dtype=None, trainer=trainer, save=params_io.save_params):
                made_by = int(path.name[1:]) - 1  # version v is step v - 1's
                if made_by < 3:
                    assert trainer.finished[made_by + 1].wait(60)
                return save(model, path, dtype=dtype)

            monkeypatch.setattr(params_io, "save_params", late_save)
        out = tmp_path / str(overlap)
        await run(
            trainer,
            Source(events),
            SlowPublisher(events),
            out,
            steps=3,
            overlap=overlap,
            export_dtype="bfloat16",
        )
        monkeypatch.undo()

        def leaves(params):
            return [np.asarray(x) for x in jax.tree.leaves(params)]

        weights[overlap] = {v: leaves(trainer.load_serving(export_path(out, v))) for v in (2, 3, 4)}
        last = leaves(jax.tree.map(lambda x: x.astype(jnp.bfloat16), trainer.params))
        for a, b in zip(weights[overlap][4], last, strict=True):
            np.testing.assert_array_equal(a, b.astype(a.dtype))
    for v in (2, 3, 4):
        for a, b in zip(weights[False][v], weights[True][v], strict=True):
            np.testing.assert_array_equal(a, b)
    # Consecutive versions differ: an export that read a later step's params would show.
    pairs = zip(weights[True][2], weights[True][3], strict=True)
    assert any(not np.array_equal(a, b) for a, b in pairs)


async def test_synchronous_rl_stays_synchronous_with_the_overlap(policy, tmp_path):
    """max_staleness = 0 through the real rollout buffer and admission: the next batch's
    episodes cannot start before the servers serve the new version, so every token a step
    trains on was sampled by the trainer's own version, with the publish in the background."""
    from envs.config import TerminalConfig, TextopsConfig
    from envs.textops import TextopsAnswerShell, generate_textops
    from rl.data import ByteTokenizer, ChatRenderer
    from rl.orchestrator.buffer import RolloutBuffer
    from rl.orchestrator.config import OrchestratorConfig
    from rl.orchestrator.runner import Backends, RolloutRunner
    from tests.fakes import FakeAgentClient

    steps = 3
    tasks = generate_textops(
        TextopsConfig(num_tasks=8, seed=0, ops=["reverse", "upper"], from_file_prob=0.0)
    )
    cfg = OrchestratorConfig(arm="real", group_size=2, batch_size=4, max_staleness=0, seed=0)
    client = FakeAgentClient(tasks)
    queue: asyncio.Queue = asyncio.Queue()
    runner = RolloutRunner(
        cfg,
        TerminalConfig(max_turns=4, command_timeout_s=10),
        ChatRenderer(ByteTokenizer()),
        Backends(real=TextopsAnswerShell),
        client=client,
        sinks=(queue.put_nowait,),
    )
    buffer = RolloutBuffer(runner, tasks, queue=queue, steps=steps, seed=0, batch_timeout_s=60)
    events: list = []

    class Loading(SlowPublisher):
        async def publish(self, path, version):
            report = await super().publish(path, version)
            client.version = version  # the servers serve it from now on
            return report

    trained: list[set] = []

    class Recorded:
        """The buffer, recording the versions of the generated tokens of each batch."""

        def __getattr__(self, name):
            return getattr(buffer, name)

        async def next_batch(self):
            batch = await buffer.next_batch()
            gen = {
                v
                for t in batch
                for v, m in zip(t.policy_version, t.loss_mask, strict=True)
                if m and v is not None
            }
            trained.append(gen)
            return batch

    client.version = 1
    await buffer.start(1)
    try:
        summary = await rl_loop(
            fresh(policy),
            Recorded(),
            Loading(events),
            run_dir=tmp_path,
            steps=steps,
            rows=4,
            seq_len=32,
            loss_cfg=PolicyLossConfig(),
            pad_id=0,
            overlap_publish=True,
            progress=False,
        )
    finally:
        await buffer.close()
    assert trained == [{1}, {2}, {3}]  # batch k is trained at version k: staleness 0
    assert [h["staleness_max"] for h in summary["history"]] == [0, 0, 0]
    assert buffer.dropped_stale == 0


async def test_with_several_processes_the_export_stays_in_line(policy, tmp_path, monkeypatch):
    """Several processes export together (collectives, in the same order everywhere): the
    export is written before `publish` returns, and only the publish runs in the background."""
    from rl.model.integrity import MANIFEST
    from rl.train import multihost
    from rl.train.loop import _Versions

    monkeypatch.setattr(multihost, "process_count", lambda: 2)
    events: list = []
    source = Source(events)
    versions = _Versions(
        fresh(policy),
        source,
        SlowPublisher(events),
        run_dir=tmp_path,
        export_dtype=None,
        overlap=True,
    )
    record: dict = {}
    await versions.publish(2, record)
    assert (export_path(tmp_path, 2) / MANIFEST).exists() and record["export_s"] > 0
    assert versions.in_flight and ("served", 2) not in events
    await versions.wait()
    assert events[-2:] == [("served", 2), ("set_version", 2)]
    assert record["publish_load_s"] == LOAD_S
