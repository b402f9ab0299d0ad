"""The run directory every subcommand writes (docs/architecture.md §4): its file names, in one
place, and the metrics log that jobs, trainers and the orchestrator append to (mirrored to
TensorBoard and, when
`configure_wandb` turned it on, W&B: `rl.data.metrics_sinks`).

    <run>/config.yaml  metrics.jsonl  eval.json  fidelity.json  summary.json  report.html
          trajectories/  checkpoints/  weights/  logs/  heldout_tasks.json  stage.json
          tensorboard/  wandb/  .lock

A job claims its run directory (`lock_run_dir`, done by `launch.config.write_config`) for as
long as it runs, so two jobs never write one directory.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import math
import os
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rl.data.metrics_sinks import RunSinks

CONFIG = "config.yaml"
"""The resolved config the run was started with."""
METRICS = "metrics.jsonl"
"""One JSON object per line: losses, rewards, rollout summaries, evaluations."""
EVAL = "eval.json"
"""Policy evaluations: `{label: {arm: result}}` (`before` / `after` RL, `eval`)."""
FIDELITY = "fidelity.json"
"""`simloop eval-sim`: the simulator's fidelity on replayed real commands (arm c)."""
SUMMARY = "summary.json"
"""`simloop demo`: the numbers of the whole pipeline."""
STAGE = "stage.json"
"""`simloop demo`: a finished stage's record (a rerun skips the stage)."""
REPORT = "report.html"
"""`simloop report`: the self-contained page."""
HELDOUT_TASKS = "heldout_tasks.json"
"""`simloop train-sim`: the task ids it held out of training."""
TRAJECTORIES = "trajectories"
CHECKPOINTS = "checkpoints"
WEIGHTS = "weights"
"""Serving-format exports (`weights/final`, `weights/v000007`)."""
LOGS = "logs"
TENSORBOARD = "tensorboard"
"""TensorBoard event files of the scalars in `metrics.jsonl`."""
LOCK = ".lock"
"""Held (`fcntl.flock`) by the job writing the run directory; says its pid and command."""


def read_json(path: str | Path | None, default: Any = None) -> Any:
    """A JSON file's content, or `default` when it does not exist (yet)."""
    if path is None or not Path(path).exists():
        return default
    return json.loads(Path(path).read_text())


def read_metrics(path: str | Path | None) -> list[dict]:
    """The records of a `metrics.jsonl` ([] when absent); a torn last line (a killed run) is
    skipped."""
    if path is None or not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_evals(run_dir: str | Path) -> dict:
    """`eval.json` of a run directory ({label: {arm: result}}), or {} before the first."""
    return read_json(Path(run_dir) / EVAL, {})


def plain(v: Any) -> Any:
    """A JSON-safe scalar: device/numpy scalars become Python numbers, non-finite floats None."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


_WRITER = True


def set_writer(writes: bool) -> None:
    """Whether this process writes run directories: their lock, metrics, TensorBoard and W&B.
    A multi-process job (`launch/distributed.py`) sets it False on every process but 0, whose
    writes would be copies of process 0's (every process computes the same replicated
    metrics)."""
    global _WRITER
    _WRITER = bool(writes)


def is_writer() -> bool:
    return _WRITER


class MetricsLog:
    """Appends one JSON object per line to `<run>/metrics.jsonl` (flushed every write, so a
    killed run keeps what it logged), and the same scalars to `<run>/tensorboard/` and W&B.

    Jobs open many logs on one run directory; they share that directory's TensorBoard file and
    W&B run (one per process), which stay open until `close()` on any of them, or exit."""

    def __init__(self, run_dir: str | Path, filename: str = METRICS):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not _WRITER:
            return
        line = json.dumps({k: plain(v) for k, v in record.items()})
        with self.path.open("a") as f:
            f.write(line + "\n")
        _sinks(self.run_dir).write(record)

    def truncate(self, stages: Iterable[str], after_step: int) -> int:
        """Drop the records of `stages` past `after_step` (and torn lines): what a run killed
        after its last checkpoint logged, before it resumes from that checkpoint and logs
        those steps again. Returns how many records were dropped."""
        if not _WRITER or not self.path.exists():
            return 0
        stages = set(stages)
        keep, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            step = r.get("step") if isinstance(r, dict) else None
            if r.get("stage") in stages and isinstance(step, int) and step > after_step:
                dropped += 1
                continue
            keep.append(line)
        if dropped:
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text("".join(f"{line}\n" for line in keep))
            os.replace(tmp, self.path)
        return dropped

    def last(self, stage: str) -> dict[str, Any]:
        """The last record of `stage` that has a step, {} when there is none."""
        rows = [r for r in read_metrics(self.path) if r.get("stage") == stage and "step" in r]
        return rows[-1] if rows else {}

    def close(self) -> None:
        """Close the run directory's TensorBoard file and finish its W&B run; a later write
        opens new ones."""
        with _SINKS_LOCK:
            sinks = _SINKS.pop(self.run_dir.resolve(), None)
        if sinks is not None:
            sinks.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunDirInUse(OSError):
    """Another live process holds the run directory's lock."""


_LOCKS: dict[Path, int] = {}
_LOCKS_LOCK = threading.Lock()


def lock_run_dir(run_dir: str | Path) -> Path:
    """Claim `run_dir` for this process until it exits (an `fcntl.flock` on `<run>/.lock`,
    which the kernel drops with the process, so a killed job never blocks the next one).
    Claiming a directory this process already holds is a no-op; one held by another process
    raises RunDirInUse naming its pid. Nested run directories (the demo's stages) are other
    directories with their own locks. A process that is not the run's writer (`set_writer`)
    claims nothing: its job's process 0 holds the lock."""
    path = Path(run_dir).resolve() / LOCK
    if not _WRITER:
        return path
    with _LOCKS_LOCK:
        if path in _LOCKS:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirInUse(
                f"run directory {path.parent} is in use by another job (pid {holder}); wait "
                "for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} ({' '.join(sys.argv)})\n".encode(), 0)
        os.set_inheritable(fd, False)
        _LOCKS[path] = fd
    return path


_SINKS: dict[Path, RunSinks] = {}
_SINKS_LOCK = threading.Lock()


def _sinks(run_dir: Path) -> RunSinks:
    key = run_dir.resolve()
    with _SINKS_LOCK:
        if key not in _SINKS:
            _SINKS[key] = RunSinks(key, key / TENSORBOARD, key / CONFIG)
        return _SINKS[key]


def close_all() -> None:
    """Close every run directory's TensorBoard file and W&B run this process opened."""
    with _SINKS_LOCK:
        open_sinks = list(_SINKS.values())
        _SINKS.clear()
    for sinks in open_sinks:
        sinks.close()


atexit.register(close_all)
