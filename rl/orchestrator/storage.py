"""Trajectory storage in a run directory: JSONL shards (human-readable, atomic per shard) and
ArrayRecord shards of the same records (random access for grain:
`grain.sources.ArrayRecordDataSource(paths)` yields the JSON bytes)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl.data.rundir import TRAJECTORIES
from rl.data.trajectory import Trajectory, validate, write_jsonl


class TrajectoryWriter:
    """Validates every trajectory and writes shards of `shard_size` into `<run>/trajectories/`.
    Call `add` per finished episode and `close` at the end (it flushes the last shard)."""

    def __init__(self, run_dir: str | os.PathLike, prefix: str = "rollout", shard_size: int = 256):
        self.dir = Path(run_dir) / TRAJECTORIES
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.shard_size = prefix, shard_size
        existing = sorted(self.dir.glob(f"{prefix}-*.jsonl"))
        self._next = len(existing)
        self._buffer: list[Trajectory] = []
        self.written = 0
        self.paths: list[Path] = []

    def add(self, traj: Trajectory) -> None:
        validate(traj)
        self._buffer.append(traj)
        if len(self._buffer) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        from array_record.python.array_record_module import ArrayRecordWriter

        name = f"{self.prefix}-{self._next:05d}"
        jsonl = write_jsonl(self.dir / f"{name}.jsonl", self._buffer)
        tmp = self.dir / f".{name}.array_record.tmp"
        writer = ArrayRecordWriter(str(tmp), "group_size:1")
        for traj in self._buffer:
            writer.write(json.dumps(traj.to_dict()).encode())
        writer.close()
        os.replace(tmp, self.dir / f"{name}.array_record")
        self.paths.append(jsonl)
        self.written += len(self._buffer)
        self._buffer.clear()
        self._next += 1

    def close(self) -> None:
        self.flush()
