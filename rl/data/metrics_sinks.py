"""Where the records of `metrics.jsonl` are also watched: TensorBoard event files under
`<run>/tensorboard/`, and Weights & Biases when a job turns it on (`configure_wandb`, which
`simloop` calls from `run.wandb`). `rl.data.rundir.MetricsLog` feeds both; nothing else
should write here.

Tags: every finite number in a record becomes the scalar `<prefix>/<key>`, where the prefix is
the record's `stage` followed by its string `event`, `label` and `arm` (those present):

    {"stage": "sim_sft", "step": 10, "loss": 1.2}
        -> sim_sft/loss at step 10
    {"stage": "sim_sft", "event": "summary", "wall_s": 31.0}
        -> sim_sft/summary/wall_s
    {"stage": "eval", "label": "before", "arm": "real", "success_rate": 0.4,
     "by_kind": {"sort": {"success": 0.5}}}
        -> eval/before/real/success_rate, eval/before/real/by_kind/sort/success
    {"stage": "rl_rollout", "arm": "closed_loop", "status": {"ok": 12}, "active_per_turn": [...]}
        -> rl_rollout/closed_loop/status/ok

Nested dicts are followed two levels down; booleans count as 0/1; strings, lists, None and
non-finite numbers are skipped, as are `step` and `time`. The step is the record's `step`, or
else the number of step-less records of that stage seen so far by this process (0, 1, ...).
In W&B each stage plots against its own `<stage>/step`, so stages that restart their step
count (warm start, then RL) do not fight over W&B's one monotonic step.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

logger = logging.getLogger(__name__)

QUALIFIERS = ("event", "label", "arm")
"""String fields of a record that name the series rather than measure anything."""
NOT_SCALARS = frozenset({"stage", "step", "time", *QUALIFIERS})
NESTING = 2
"""How many levels of nested dicts become tags (`status/ok`, `by_kind/sort/success`)."""
WANDB_MODES = ("auto", "offline", "online")


def _number(v: Any) -> float | None:
    """A finite float from a Python, NumPy or JAX scalar, else None (bools are 0/1)."""
    if hasattr(v, "item") and getattr(v, "size", 1) == 1:
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def flatten(record: dict[str, Any]) -> tuple[str, int | None, dict[str, float]]:
    """`(stage, step or None, {tag: value})` of one metrics record (tag scheme above)."""
    stage = str(record.get("stage") or "metrics")
    names = [record[k] for k in QUALIFIERS if isinstance(record.get(k), str) and record[k]]
    prefix = "/".join([stage, *names])
    step = _number(record.get("step"))
    scalars: dict[str, float] = {}

    def add(tag: str, v: Any, depth: int) -> None:
        if isinstance(v, dict):
            if depth < NESTING:
                for k, x in v.items():
                    add(f"{tag}/{k}", x, depth + 1)
            return
        x = _number(v)
        if x is not None:
            scalars[tag] = x

    for k, v in record.items():
        if k not in NOT_SCALARS:
            add(f"{prefix}/{k}", v, 0)
    return stage, None if step is None else int(step), scalars


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ 0x82F63B78 if n & 1 else n >> 1
        table.append(n)
    return tuple(table)


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C (Castagnoli) of `data`, rotated and offset."""
    crc, table = 0xFFFFFFFF, _CRC32C
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields: a negative number takes ten bytes, as protobuf writes it
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _value_bytes(tag: str, value: float) -> bytes:
    """One `Summary.Value`: its tag (left out when empty) and its float32 `simple_value`."""
    tag_field = _field_bytes(1, tag.encode()) if tag else b""
    return tag_field + _varint(2 << 3 | 5) + struct.pack("<f", value)


def event_bytes(
    wall_time: float,
    *,
    step: int = 0,
    file_version: str | None = None,
    scalars: dict[str, float] | None = None,
) -> bytes:
    """A serialized `tensorflow.Event` with the few fields simloop writes, byte for byte as
    protobuf writes it (event.proto: wall_time = 1, step = 2, and the oneof `what` holding
    file_version = 3 or summary = 5; summary.proto: Summary.value = 1, Value.tag = 1, and
    Value's oneof holding simple_value = 2, a float32). Proto3 leaves out fields at their
    default (0, "") unless they are in a oneof."""
    if file_version is not None and scalars is not None:
        raise ValueError("an Event holds a file_version or a summary, not both")
    out = bytearray()
    if struct.pack("<d", wall_time) != bytes(8):  # -0.0 is written, as protobuf does
        out += _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars is not None:
        values = b"".join(_field_bytes(1, _value_bytes(t, v)) for t, v in scalars.items())
        out += _field_bytes(5, values)
    return bytes(out)


class EventFile:
    """One TensorBoard event file (TFRecord framing of `Event` protos), written synchronously
    and flushed every write: a killed run keeps its events, and no thread is left behind.
    (tensorboardX's `SummaryWriter` queues events on a thread and names files by the second,
    so two writers started in the same second on one host would share a name.) The protos are
    encoded here (`event_bytes`) rather than by tensorboardX, whose package imports PyTorch
    when it is installed: 1.4 s of CPU in every process that logs (2026-12-06)."""

    _opened = 0
    _opened_lock = threading.Lock()

    def __init__(self, logdir: str | Path):
        with EventFile._opened_lock:
            EventFile._opened += 1
            n = EventFile._opened
        logdir = Path(logdir)
        logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # Readers (TensorBoard, ours) take a directory's files in name order: the counter is
        # zero-padded so that the 10th file opened within a second sorts after the 9th.
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{n:06d}"
        self.path = logdir / name
        self._file = self.path.open("ab")
        self._write(event_bytes(now, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header
            + struct.pack("<I", masked_crc32c(header))
            + data
            + struct.pack("<I", masked_crc32c(data))
        )
        self._file.flush()

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float) -> None:
        self._write(event_bytes(wall_time, step=step, scalars=scalars))

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class WandbOptions:
    """How this process's run directories log to W&B."""

    project: str = "simloop"
    group: str | None = None
    """Every run directory of one `simloop` command shares it (the config's `run.name`)."""
    mode: Literal["offline", "online"] = "offline"
    """`offline` writes `<run>/wandb/` (`wandb sync` uploads it later) and needs no network."""


_wandb: WandbOptions | None = None
_wandb_warned = False


def configure_wandb(
    enabled: bool, *, project: str = "simloop", group: str | None = None, mode: str = "auto"
) -> WandbOptions | None:
    """Turn W&B logging on (or off) for the run directories this process logs to from now on.
    `mode="auto"` is online when WANDB_API_KEY is set, else offline. When W&B is asked for but
    `wandb` is not installed, warns once and logs to metrics.jsonl and TensorBoard only.
    Returns the options in force (None: off)."""
    global _wandb, _wandb_warned
    if mode not in WANDB_MODES:
        raise ValueError(f"wandb mode={mode!r} is invalid: one of {WANDB_MODES}")
    _wandb = None
    if not enabled:
        return None
    try:
        import wandb  # noqa: F401
    except ImportError:
        if not _wandb_warned:
            _wandb_warned = True
            logger.warning(
                "run.wandb is on but wandb is not installed (pip install 'simloop[wandb]'): "
                "metrics go to metrics.jsonl and TensorBoard only"
            )
        return None
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    _wandb = WandbOptions(project=project, group=group, mode=mode)  # type: ignore[arg-type]
    return _wandb


def wandb_options() -> WandbOptions | None:
    """The W&B options in force for newly opened run directories (None: off)."""
    return _wandb


class WandbRun:
    """One W&B run per run directory, its files under `<run>/wandb/`, its config the run's
    resolved `config.yaml` when that exists."""

    def __init__(self, run_dir: Path, options: WandbOptions, config_file: Path | None = None):
        import wandb

        config = None
        if config_file is not None and config_file.exists():
            config = yaml.safe_load(config_file.read_text())
        self._stages: set[str] = set()
        self.run = wandb.init(
            project=options.project,
            group=options.group,
            name=run_dir.name,
            dir=str(run_dir),
            mode=options.mode,
            config=config,
            # `simloop demo` opens a run directory per stage in one process.
            reinit="create_new",
            # The job's console already goes to the terminal and `logs/`; W&B wrapping stdout
            # would fight the progress bars.
            settings=wandb.Settings(console="off"),
        )
        # Finish before W&B's own exit hook (registered on import, so it would run first)
        # takes its service down under an unfinished run.
        atexit.register(self.close)

    def log(self, stage: str, step: int, scalars: dict[str, float]) -> None:
        if stage not in self._stages:
            self._stages.add(stage)
            self.run.define_metric(f"{stage}/step", hidden=True)
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self.run.log({f"{stage}/step": step, **scalars})

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.run is not None:
            self.run.finish()
            self.run = None


class RunSinks:
    """The TensorBoard file and W&B run of one run directory; opened on the first record."""

    def __init__(self, run_dir: Path, tensorboard_dir: Path, config_file: Path | None = None):
        self.run_dir = run_dir
        self.tensorboard_dir = tensorboard_dir
        self.config_file = config_file
        self._events: EventFile | None = None
        self._wandb: WandbRun | None = None
        self._wandb_options = wandb_options()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        stage, step, scalars = flatten(record)
        with self._lock:
            if step is None:
                step = self._counts[stage]
                self._counts[stage] += 1
            if not scalars:
                return
            if self._events is None:
                self._events = EventFile(self.tensorboard_dir)
                self._open_wandb()
            wall = _number(record.get("time")) or time.time()
            self._events.add_scalars(step, scalars, wall)
            if self._wandb is not None:
                self._wandb.log(stage, step, scalars)

    def _open_wandb(self) -> None:
        if self._wandb_options is None:
            return
        try:
            self._wandb = WandbRun(self.run_dir, self._wandb_options, self.config_file)
        except Exception as e:
            # Recovered on purpose: an unreachable or misconfigured W&B must not cost the run;
            # every scalar is still in metrics.jsonl and TensorBoard.
            logger.warning("W&B logging is off for %s: %s: %s", self.run_dir, type(e).__name__, e)
            self._wandb_options = None

    def close(self) -> None:
        with self._lock:
            if self._events is not None:
                self._events.close()
                self._events = None
            if self._wandb is not None:
                self._wandb.close()
                self._wandb = None
