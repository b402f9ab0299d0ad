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
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
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


def _step_and_wait(trainer: Trainer, batch: dict) -> dict:
    return jax.block_until_ready(trainer.step(batch))


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
    source v. Blocking device work runs in a thread so rollouts keep flowing.

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
    if log is not None:
        log.truncate(("rl",), start)
    began = time.perf_counter()
    with _Progress("rl", steps, start, progress) as bar:
        for step in range(start, steps):
            version = base_version + step
            t = time.perf_counter()
            episodes = await source.next_batch() if source is not None else []
            batch, stats = build_rl_batch(
                episodes, rows=rows, seq_len=seq_len, cfg=loss_cfg, version=version, pad_id=pad_id
            )
            if multi:  # process 0's batch, on every process (each places its own rows)
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
            publish: dict[str, Any] = {}
            if done % publish_every == 0 or done == steps:
                t = time.perf_counter()
                path = export_path(run_dir, new_version)
                await asyncio.to_thread(trainer.export_serving, path, export_dtype)
                save_s = time.perf_counter() - t
                publish = {"export_s": save_s}
                if publisher is not None:  # every process exported; one publishes
                    report = await publisher.publish(str(path), new_version)
                    publish["publish_load_s"] = report.load_s
                    publish["publish_first_token_s"] = report.first_token_s
                publish["publish_total_s"] = time.perf_counter() - t
                times["publish_s"] += publish["publish_total_s"]
            if source is not None:
                await source.set_version(new_version)
            times["data_s"] += data_s
            times["step_s"] += step_s
            pending.append(
                (
                    done,
                    metrics,
                    {"version": new_version, "data_wait_s": data_s, **publish, **stats.to_dict()},
                )
            )
            if done % log_every == 0 or done == steps:
                pulled = await asyncio.to_thread(fetch, [m for _, m, _ in pending])
                for (s, _, info), m in zip(pending, pulled, strict=True):
                    record = {
                        "stage": "rl",
                        "step": s,
                        **{k: float(v) for k, v in m.items()},
                        **info,
                    }
                    history.append(record)
                    if log is not None:
                        log.write(record)
                    if on_log is not None:
                        on_log(record)
                pending = []
                r = history[-1]
                bar.update(
                    done,
                    f"reward {r['reward_mean']:.3f} loss {r['loss']:+.4f} "
                    f"kl {r['mismatch_kl']:+.1e} stale {r['staleness_mean']:.1f}",
                )
            if ckpt is not None and (done % ckpt_every == 0 or done == steps):
                t = time.perf_counter()
                await asyncio.to_thread(
                    ckpt.save, done, trainer.state, {"stage": "rl", "version": new_version}
                )
                times["checkpoint_s"] += time.perf_counter() - t
    if ckpt is not None:
        await asyncio.to_thread(ckpt.wait)
    wall = time.perf_counter() - began
    summary = {
        "stage": "rl",
        "steps": trainer.step_count,
        "started_at_step": start,
        "wall_s": wall,
        **times,
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
