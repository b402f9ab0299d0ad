"""Trajectory storage in a run directory: JSONL shards (human-readable, one record appended per
finished episode) and ArrayRecord shards of the same records, written when a JSONL shard is
complete (random access for grain: `grain.sources.ArrayRecordDataSource(paths)` yields the
JSON bytes).

Crash safety: each record goes to its shard in one `write` of the whole line and is on disk
(in the page cache) before `add` returns, so a killed job loses no finished episode and leaves
at most a torn last line, which `rl.data.trajectory.iter_jsonl` skips and reports.
"""

from __future__ import annotations

import os
from pathlib import Path

from rl.data.rundir import TRAJECTORIES
from rl.data.trajectory import Trajectory, to_json_line


class TrajectoryWriter:
    """Validates every trajectory and appends it to `<run>/trajectories/<prefix>-NNNNN.jsonl`,
    `shard_size` per shard. Call `add` per finished episode and `close` at the end (it closes
    the last shard and writes its ArrayRecord twin)."""

    def __init__(self, run_dir: str | os.PathLike, prefix: str = "rollout", shard_size: int = 256):
        self.dir = Path(run_dir) / TRAJECTORIES
        self.dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.shard_size = prefix, shard_size
        # After every shard on disk (a crashed run's too): a shard is never appended to twice.
        taken = [p.name[len(prefix) + 1 : -6] for p in self.dir.glob(f"{prefix}-*.jsonl")]
        self._next = max((int(n) + 1 for n in taken if n.isdigit()), default=0)
        self._fd: int | None = None
        self._records: list[bytes] = []
        self.written = 0
        self.paths: list[Path] = []

    def add(self, traj: Trajectory) -> None:
        line = (to_json_line(traj) + "\n").encode("utf-8")  # validates before anything is written
        if self._fd is None:
            path = self.dir / f"{self.prefix}-{self._next:05d}.jsonl"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
            self.paths.append(path)
        view = memoryview(line)
        while view:  # one write for the whole line; a short write (rare) continues it
            view = view[os.write(self._fd, view) :]
        self._records.append(line[:-1])
        self.written += 1
        if len(self._records) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        """Close the current shard (fsync) and write its ArrayRecord twin atomically."""
        if self._fd is None:
            return
        from array_record.python.array_record_module import ArrayRecordWriter

        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        name = f"{self.prefix}-{self._next:05d}"
        tmp = self.dir / f".{name}.array_record.tmp"
        writer = ArrayRecordWriter(str(tmp), "group_size:1")
        for record in self._records:
            writer.write(record)
        writer.close()
        os.replace(tmp, self.dir / f"{name}.array_record")
        self._records.clear()
        self._next += 1

    def close(self) -> None:
        self.flush()
