"""The training loops: supervised (`sft_loop`) and RL (`rl_loop`), one explicit loop each.

Periodic work are hooks every N steps: metrics are pulled from the device every `log_every`
steps (never per step), checkpoints every `CheckpointConfig.every_steps`, weight publishing
every `publish_every`. Phases are timed separately (data wait, step, checkpoint, publish) and
written to `metrics.jsonl` with the losses.

    resume(trainer, ckpt, iterator)                # continue a run directory's latest checkpoint
    sft_loop(trainer, iterator, steps=..., ckpt=ckpt, log=MetricsLog(run_dir), stage="sim_sft")
    await rl_loop(trainer, source, publisher, ...)

A resumed loop first drops the records its stage logged past the checkpoint it resumed from
(the killed run's steps, which it trains again), so every step appears once in
`metrics.jsonl`. A non-finite loss or gradient norm stops the loop with `TrainingDiverged`
before anything of that state is saved or published: the last checkpoint stays the last good
one.

Components of `rl_loop`: the loop owns a `_Versions` (the policy versions on their way to the
servers: export, publish, then `source.set_version`, at most one in flight, in a background
task with `overlap_publish`) and calls it at four points: `during(next_batch)` (a failed
publish ends the data wait), `publish(v)` after a step (`announce(v)` when v is not
published), `wait()` after the last step and `cancel()` when the loop fails.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from rl.data.rundir import MetricsLog
from rl.model.publish import WeightPublisher
from rl.train import multihost
from rl.train.checkpoint import Checkpointer, export_path
from rl.train.config import PolicyLossConfig
from rl.train.multihost import fetch
from rl.train.rollouts import EpisodeSource, build_rl_batch
from rl.train.trainer import Trainer

logger = logging.getLogger(__name__)


class _Progress:
    """A rich progress bar with a one-line status (disabled when `enabled` is False)."""

    def __init__(self, desc: str, total: int, completed: int, enabled: bool = True):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(f"[bold]{desc}[/]"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )
            self.task = self.bar.add_task("", total=total, completed=completed)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, completed: int, status: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=completed, description=status)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the message names the stage, the step and the last
    checkpoint, which is untouched."""


def _check_finite(stage: str, step: int, metrics: dict, ckpt: Checkpointer | None) -> None:
    """TrainingDiverged when the step's loss or gradient norm (whose NaN the update carries
    into every parameter) is not finite."""
    bad = {
        k: float(v)
        for k, v in fetch({k: metrics[k] for k in ("loss", "grad_norm") if k in metrics}).items()
    }
    bad = {k: v for k, v in bad.items() if not math.isfinite(v)}
    if not bad:
        return
    kept = "no checkpoint was written"
    if ckpt is not None:
        ckpt.wait()
        last = ckpt.latest_step()
        kept = f"the last good checkpoint is step {last} in {ckpt.directory}" if last else kept
    what = ", ".join(f"the {k} is {v}" for k, v in bad.items())
    raise TrainingDiverged(
        f"{stage}: {what} at step {step}: training diverged and was stopped ({kept}); lower "
        "the learning rate or check the data"
    )


def resume(trainer: Trainer, ckpt: Checkpointer | None, iterator: Any = None) -> dict | None:
    """Restore the newest checkpoint that verifies into `trainer` (and the data iterator's
    position); returns its extra dict, or None when there is nothing to resume. Newer
    checkpoints that do not verify are skipped, each named on stderr with the reason."""
    if ckpt is None:
        return None
    found = ckpt.restore_latest(trainer.abstract_state())
    if found is None:
        return None
    for step, why in found.skipped:
        print(f"checkpoint step {step} skipped: {why}", file=sys.stderr, flush=True)
    if found.sealed_now:
        print(
            f"checkpoint step {found.step} had no manifest (killed before it was sealed): it "
            "read back complete and finite, and is sealed now",
            file=sys.stderr,
            flush=True,
        )
    trainer.state = found.state
    if iterator is not None and found.extra.get("data") is not None:
        iterator.set_state(found.extra["data"])
    logger.info("resumed from %s step %d", ckpt.directory, found.step)
    return found.extra


def sft_loop(
    trainer: Trainer,
    batches: Iterator[dict],
    *,
    steps: int,
    log: MetricsLog | None = None,
    stage: str = "sft",
    log_every: int = 10,
    ckpt: Checkpointer | None = None,
    ckpt_every: int = 50,
    progress: bool = True,
    on_log: Callable[[dict], None] | None = None,
) -> dict[str, Any]:
    """Train until `trainer` has taken `steps` optimizer steps (continuing a restored step
    count). Returns a summary; the last pulled metrics are in `summary["last"]`."""
    start = trainer.step_count
    pending: list[tuple[int, dict]] = []
    times = {"data_s": 0.0, "checkpoint_s": 0.0}
    tokens = 0
    last: dict[str, Any] = {}
    if log is not None:
        log.truncate((stage, f"{stage}_eval"), start)
        if start >= steps:  # nothing to train: report where the run ended
            last = log.last(stage)
    began = time.perf_counter()
    window = began
    with _Progress(stage, steps, start, progress) as bar:
        for step in range(start, steps):
            t = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                logger.warning("%s: the dataset ran out after %d of %d steps", stage, step, steps)
                break
            times["data_s"] += time.perf_counter() - t
            pending.append((step + 1, trainer.step(batch)))
            done = step + 1
            saving = ckpt is not None and (done % ckpt_every == 0 or done == steps)
            if done % log_every == 0 or done == steps or saving:
                pulled = fetch([m for _, m in pending])
                now = time.perf_counter()
                for (s, _), m in zip(pending, pulled, strict=True):
                    tokens += int(m.get("tokens", 0))
                    last = {"stage": stage, "step": s, **{k: float(v) for k, v in m.items()}}
                    if log is not None:
                        log.write(last)
                    _check_finite(stage, s, last, ckpt)
                last = {**last, "steps_per_s": len(pending) / max(now - window, 1e-9)}
                window, pending = now, []
                if on_log is not None:
                    on_log(last)
                bar.update(done, f"loss {last['loss']:.4f}")
            if saving:
                t = time.perf_counter()
                data = batches.get_state() if hasattr(batches, "get_state") else None
                extra = {"stage": stage, "data": data}
                ckpt.save(done, trainer.state, extra)
                times["checkpoint_s"] += time.perf_counter() - t
    if ckpt is not None:
        t = time.perf_counter()
        ckpt.wait()
        times["checkpoint_s"] += time.perf_counter() - t
    wall = time.perf_counter() - began
    summary = {
        "stage": stage,
        "steps": trainer.step_count,
        "started_at_step": start,
        "wall_s": wall,
        "trained_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        **times,
        "last": last,
    }
    if log is not None:
        log.write(
            {
                "stage": stage,
                "event": "summary",
                **{k: v for k, v in summary.items() if k != "last"},
            }
        )
    return summary


def greedy_exact_by_group(
    trainer: Trainer,
    examples: Sequence[dict],
    groups: Sequence[str],
    *,
    batch_size: int,
    pad_id: int,
) -> dict[str, Any]:
    """Held-out greedy exact match (`Trainer.greedy_exact`, one teacher-forced forward per
    batch): `{"exact": rate over all, "by_group": {group: rate}, "counts": {group: n}}`."""
    from rl.data.datasets import padded_batches

    if len(examples) != len(groups):
        raise ValueError(f"{len(examples)} examples but {len(groups)} group labels")
    hits: list[bool] = []
    for n, batch in padded_batches(examples, batch_size=batch_size, pad_id=pad_id):
        hits += np.asarray(fetch(trainer.greedy_exact(batch)))[:n].tolist()
    by: dict[str, list[bool]] = defaultdict(list)
    for group, hit in zip(groups, hits, strict=True):
        by[group].append(hit)
    return {
        "exact": float(np.mean(hits)) if hits else float("nan"),
        "by_group": {g: float(np.mean(v)) for g, v in sorted(by.items())},
        "counts": {g: len(v) for g, v in sorted(by.items())},
    }


CANCEL_WAIT_S = 30.0
"""How long a failing loop waits for the work it cancels (a publish's HTTP calls end at once;
an export already on a thread finishes there)."""

T = TypeVar("T")


def _step_and_wait(trainer: Trainer, batch: dict) -> dict:
    return jax.block_until_ready(trainer.step(batch))


def _failed(task: asyncio.Task | None) -> bool:
    return (
        task is not None and task.done() and not task.cancelled() and task.exception() is not None
    )


class _Versions:
    """The policy versions on their way to the servers, for `rl_loop`: export, publish, then
    tell the episode source (`set_version`), in that order, one version at a time.

    With `overlap`, a version is exported and published by a background task while the loop
    takes its next batch and step, and the next publish first waits for it: at most one is in
    flight. With one process the export reads a copy of the new params made on the device
    before the next step runs (the step donates its state: XLA reuses those buffers for the
    next one), in the export dtype (a bfloat16 export of float32 params costs half a copy).
    With several processes the export stays in line, every process at once: Orbax's save and
    `sync_global_devices` are collectives and must run in the same order on every process as
    the steps' and checkpoints' do; only process 0's publish (HTTP) runs in the background.
    Without `overlap` the loop waits for every publish, as the servers load it.

    The source hears of a version only once the servers serve it (`set_version` runs in the
    task, right after `publish` returns), so admission never gets ahead of the servers and a
    token's version is always the one its server reported. A publish that fails surfaces its
    own exception at the loop's next wait: the data wait (`during`), the next publish or the
    end (`wait`)."""

    def __init__(
        self,
        trainer: Trainer,
        source: EpisodeSource | None,
        publisher: WeightPublisher | None,
        *,
        run_dir: str | Path,
        export_dtype: str | None,
        overlap: bool,
    ):
        self.trainer, self.source, self.publisher = trainer, source, publisher
        self.run_dir, self.export_dtype, self.overlap = run_dir, export_dtype, overlap
        self._task: asyncio.Task | None = None
        self._later: int | None = None
        self.record: dict | None = None
        """The step record of the version last sent; its task fills in the timings."""

    @property
    def in_flight(self) -> bool:
        return self._task is not None and not self._task.done()

    async def publish(self, version: int, record: dict) -> None:
        """Export and publish `version`; `record` (the step's) gets `export_s`,
        `publish_load_s`, `publish_first_token_s` and `publish_total_s` once it is served, and
        `publish_wait_s` (how long the loop was held here) at once. With `overlap` this returns
        as soon as the version is on its way."""
        from rl.model.params_io import save_params

        t = time.perf_counter()
        path = export_path(self.run_dir, version)
        export = None
        if self.overlap and multihost.process_count() == 1:
            await self.wait()  # at most one in flight (and one copy of the params)
            params = await asyncio.to_thread(self._snapshot)
            export = functools.partial(
                save_params, self.trainer.model(params), path, dtype=self.export_dtype
            )
        else:  # in line: every process at once, before process 0 waits on any publish
            began = time.perf_counter()
            await asyncio.to_thread(self.trainer.export_serving, path, self.export_dtype)
            record["export_s"] = time.perf_counter() - began
            await self.wait()  # at most one in flight
        self.record = record
        self._task = asyncio.create_task(
            self._send(version, path, export, record), name=f"rl-publish-v{version}"
        )
        if not self.overlap:
            await self.wait()
        record["publish_wait_s"] = time.perf_counter() - t

    def _snapshot(self) -> dict:
        dtype = None if self.export_dtype is None else jnp.dtype(self.export_dtype)

        def copy(x: jax.Array) -> jax.Array:
            return x.astype(dtype) if dtype is not None and x.dtype != dtype else x.copy()

        return jax.block_until_ready(jax.tree.map(copy, self.trainer.params))

    async def _send(
        self, version: int, path: Path, export: Callable[[], Any] | None, record: dict
    ) -> None:
        if export is not None:
            t = time.perf_counter()
            await asyncio.to_thread(export)
            record["export_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if self.publisher is not None:  # every process exported; one publishes
            report = await self.publisher.publish(str(path), version)
            record["publish_load_s"] = report.load_s
            record["publish_first_token_s"] = report.first_token_s
        # Export + publish, without the waits: what the version cost, overlapped or not.
        record["publish_total_s"] = record["export_s"] + time.perf_counter() - t
        if self.source is not None:
            await self.source.set_version(version)
            later, self._later = self._later, None
            if later is not None and later > version:
                await self.source.set_version(later)

    async def announce(self, version: int) -> None:
        """A step whose version is not published (`publish_every`): the source hears of it now,
        or after the version in flight (versions reach it in order)."""
        if self.source is None:
            return
        if self.in_flight:
            self._later = version
            return
        await self.wait()  # raises what a finished publish raised
        await self.source.set_version(version)

    async def wait(self) -> float:
        """Seconds until the version in flight is served and announced (0 when none is); raises
        the exception its export, publish or `set_version` raised."""
        task, self._task = self._task, None
        if task is None:
            return 0.0
        t = time.perf_counter()
        await task
        return time.perf_counter() - t

    async def during(self, work: Coroutine[Any, Any, T], name: str) -> T:
        """`await work` (run as task `name`), stopped by the publish in flight if that fails
        first, whose exception it raises: a data wait can hang on the publish (admission lets
        the next episodes start once the servers serve the new version)."""
        task = self._task
        if task is None or task.done():
            if _failed(task):
                work.close()
                await self.wait()
            return await work
        job = asyncio.create_task(work, name=name)
        try:
            await asyncio.wait({job, task}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done() and _failed(task):
                await self.wait()
            return await job
        finally:
            if not job.done():
                job.cancel()
                await asyncio.wait({job}, timeout=CANCEL_WAIT_S)

    async def cancel(self) -> None:
        """The loop is failing: cancel the version in flight (bounded). Its own exception, if
        it had one, is logged: the loop's is the one raised."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
        if _failed(task):
            logger.error(
                "publishing %s failed as the RL loop stopped: %r", task.get_name(), task.exception()
            )


def _ready(pending: list[tuple[int, dict, dict]], held: dict | None) -> int:
    """How many of `pending`'s records are complete: those before `held` (the record of the
    version in flight, whose timings are still to come)."""
    for i, (_, _, info) in enumerate(pending):
        if info is held:
            return i
    return len(pending)


async def rl_loop(
    trainer: Trainer,
    source: EpisodeSource | None,
    publisher: WeightPublisher | None,
    *,
    run_dir: str | Path,
    steps: int,
    rows: int,
    seq_len: int,
    loss_cfg: PolicyLossConfig,
    pad_id: int,
    base_version: int = 1,
    publish_every: int = 1,
    export_dtype: str | None = None,
    overlap_publish: bool = True,
    log: MetricsLog | None = None,
    log_every: int = 1,
    ckpt: Checkpointer | None = None,
    ckpt_every: int = 5,
    progress: bool = True,
    on_log: Callable[[dict], None] | None = None,
    batch_timeout_s: float = 86400.0,
) -> dict[str, Any]:
    """RL until `trainer` has taken `steps` steps. Policy version = `base_version` + step;
    `base_version` must already be served (the caller publishes the starting weights).

    Each step: wait for a batch of episodes (the orchestrator keeps sampling meanwhile, up to
    its staleness bound) -> one optimizer step -> export + publish version v -> tell the
    source v once the servers serve it. Blocking device work runs in a thread so rollouts keep
    flowing.

    `overlap_publish`: the export and publish of v run in the background while the loop takes
    its next batch and step (`_Versions`); the next publish waits for it first, so at most one
    version is in flight, and `rl_loop` returns only once the last one is served. A step's
    record is written once its version is served (so one step late) and keeps its own
    `export_s`, `publish_*_s`; `publish_wait_s` is what the loop itself waited on publishing
    (without overlap: all of it). Checkpoints read the live state; the export its own copy.

    Staleness with the overlap. A token's staleness is the trainer's version (the version of
    the params the step updates) minus the version its server reported; `build_rl_batch`
    measures it so, overlap or not. Admission (`rl/orchestrator/admission.py`) counts against
    the version the source last heard, which now lags the trainer by one while a publish is in
    flight. That only makes admission stricter: the count of episodes started by version a
    stays at most (a - a0 + S + 1) batches, so an episode delivered in start order is trained
    within S versions of its admission, and its server already served its admission version.
    What the lag loosens is the buffer's check of a straggler (delivered after later
    episodes), made against the source's version: a straggler's tokens can be S + 1 versions
    old when its batch is drawn while the previous version is still being published. So the
    bound is `max_staleness` + 1 with the overlap, and exactly `max_staleness` without it.
    S = 0 stays exactly synchronous: the next batch's episodes cannot start before the source
    hears of the new version, so a step never trains on a token older than its own version
    (and overlapping buys nothing there but the log and checkpoint time). That holds for a
    source whose episodes wait for admission (`RolloutBuffer`); one that starts a batch's
    rollouts as soon as it is asked (the harness source) would sample them with the version
    before, and `RLSession` turns the overlap off for it.

    With several processes, process 0 alone runs the episodes (`source`) and publishes
    (`publisher`); the others pass None for both. Process 0's batch reaches every process
    (`multihost.broadcast`, waiting at most `batch_timeout_s` for it), each places its own rows,
    all step, export and checkpoint together, and only process 0 writes the log."""
    multi = multihost.process_count() > 1
    if (source is None or publisher is None) != (multi and not multihost.is_primary()):
        raise ValueError(
            "rl_loop: process 0 (or the only process) needs an episode source and a publisher; "
            "the other processes of a multi-process job take neither (they receive process "
            "0's batches)"
        )
    start = trainer.step_count
    times = {"data_s": 0.0, "step_s": 0.0, "publish_s": 0.0, "checkpoint_s": 0.0}
    pending: list[tuple[int, dict, dict]] = []
    history: list[dict] = []
    versions = _Versions(
        trainer,
        source,
        publisher,
        run_dir=run_dir,
        export_dtype=export_dtype,
        overlap=overlap_publish,
    )
    if log is not None:
        log.truncate(("rl",), start)

    async def flush(bar: _Progress, done: int) -> None:
        """Write the complete records of `pending` (all of them once nothing is in flight)."""
        nonlocal pending
        n = _ready(pending, versions.record if versions.in_flight else None)
        if n == 0:
            return
        ready, pending = pending[:n], pending[n:]
        pulled = await asyncio.to_thread(fetch, [m for _, m, _ in ready])
        for (s, _, info), m in zip(ready, pulled, strict=True):
            record = {"stage": "rl", "step": s, **{k: float(v) for k, v in m.items()}, **info}
            history.append(record)
            if log is not None:
                log.write(record)
            if on_log is not None:
                on_log(record)
        r = history[-1]
        bar.update(
            done,
            f"reward {r['reward_mean']:.3f} loss {r['loss']:+.4f} "
            f"kl {r['mismatch_kl']:+.1e} stale {r['staleness_mean']:.1f}",
        )

    began = time.perf_counter()
    warned_context = False
    with _Progress("rl", steps, start, progress) as bar:
        try:
            for step in range(start, steps):
                version = base_version + step
                t = time.perf_counter()
                episodes = (
                    await versions.during(source.next_batch(), f"rl-batch-{step}")
                    if source is not None
                    else []
                )
                batch, stats = build_rl_batch(
                    episodes,
                    rows=rows,
                    seq_len=seq_len,
                    cfg=loss_cfg,
                    version=version,  # the trainer's own: staleness is measured against it
                    pad_id=pad_id,
                    row_multiple=trainer.row_multiple,
                )
                if stats.truncated_context and not warned_context:
                    warned_context = True
                    example = next(
                        t.reason for t in episodes if (t.reason or "").startswith("context full")
                    )
                    logger.warning(
                        "rl step %d: %d of %d episodes ended truncated with a full context "
                        "(e.g. %s): their later turns and trials never ran. A longer "
                        "orchestrator.max_context_tokens (with serve.engine.max_seq_len to "
                        "match) lets them; each step's record counts them (truncated_context)",
                        step + 1,
                        stats.truncated_context,
                        stats.episodes,
                        example,
                    )
                if multi:  # process 0's batch, on every process (each places its own rows)
                    # Its row count first: a densely packed batch takes only the rows it needs.
                    n = await asyncio.to_thread(
                        multihost.broadcast,
                        np.asarray(len(batch["tokens"]), np.int32),
                        name=f"rl batch {step} rows",
                        timeout_s=batch_timeout_s,
                    )
                    if not multihost.is_primary():  # shapes to receive into (values unused)
                        batch = {
                            k: np.zeros((int(n), *v.shape[1:]), v.dtype) for k, v in batch.items()
                        }
                    batch = await asyncio.to_thread(
                        multihost.broadcast,
                        batch,
                        name=f"rl batch {step}",
                        timeout_s=batch_timeout_s,
                    )
                data_s = time.perf_counter() - t
                t = time.perf_counter()
                # Wait for the device work here (in a thread: rollouts keep flowing) so step_s is
                # the step's real cost and export_s the export's alone, not the step's remainder.
                metrics = await asyncio.to_thread(_step_and_wait, trainer, batch)
                step_s = time.perf_counter() - t
                done = step + 1
                # Before anything of the new state is published or saved (the step was waited on).
                _check_finite("rl", done, metrics, ckpt)
                new_version = base_version + done
                info: dict[str, Any] = {
                    "version": new_version,
                    "data_wait_s": data_s,
                    **stats.to_dict(),
                }
                if done % publish_every == 0 or done == steps:
                    await versions.publish(new_version, info)
                    times["publish_s"] += info["publish_wait_s"]
                else:
                    await versions.announce(new_version)
                times["data_s"] += data_s
                times["step_s"] += step_s
                pending.append((done, metrics, info))
                if done % log_every == 0 or done == steps:
                    await flush(bar, done)
                if ckpt is not None and (done % ckpt_every == 0 or done == steps):
                    t = time.perf_counter()
                    await asyncio.to_thread(
                        ckpt.save, done, trainer.state, {"stage": "rl", "version": new_version}
                    )
                    times["checkpoint_s"] += time.perf_counter() - t
            waited = await versions.wait()  # the last version: served before the loop returns
            if versions.record is not None:
                versions.record["publish_wait_s"] += waited
            times["publish_s"] += waited
            await flush(bar, steps)
        except BaseException:
            await versions.cancel()
            raise
    if ckpt is not None:
        await asyncio.to_thread(ckpt.wait)
    wall = time.perf_counter() - began
    summary = {
        "stage": "rl",
        "steps": trainer.step_count,
        "started_at_step": start,
        "wall_s": wall,
        **times,
        "publish_total_s": sum(h.get("publish_total_s", 0.0) for h in history),
        "overlap_publish": overlap_publish,
        "history": history,
    }
    if log is not None:
        log.write(
            {
                "stage": "rl",
                "event": "summary",
                **{k: v for k, v in summary.items() if k != "history"},
            }
        )
    return summary
