"""Reading a run directory for the report: a file of a single job's directory or of a demo
stage's (`find`), JSON that may be absent, the first episodes of a trajectory folder."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rl.data.rundir import read_evals, read_json, read_metrics

__all__ = ["find", "read_evals", "read_json", "read_metrics", "trajectories"]


def find(run_dir: Path, name: str, subdirs: Sequence[str]) -> Path | None:
    for sub in ("", *subdirs):
        p = run_dir / sub / name
        if p.exists():
            return p
    return None


def trajectories(directory: Path | None, prefix: str, limit: int) -> list[dict]:
    if directory is None or not directory.is_dir():
        return []
    out: list[dict] = []
    for path in sorted(directory.glob(f"{prefix}*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
                if len(out) >= limit:
                    return out
    return out
