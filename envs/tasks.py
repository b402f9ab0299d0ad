"""The `Task` schema (id, instruction, setup, reward spec) and its JSONL form.

One JSON object per line:

    {"id": "textops-0", "instruction": "...", "family": "textops",
     "setup": {"files": {"input.txt": "abc\\n"}, "commands": []},
     "reward": {"name": "textops", "params": {"op": "reverse", "text": "abc"}},
     "metadata": {}}

`setup`, `reward`, `family` and `metadata` may be left out (no setup; `exact_match` reward).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envs.shell import TaskSetup

_TASK_KEYS = ("id", "instruction", "family", "setup", "reward", "metadata")


@dataclass(frozen=True)
class RewardSpec:
    """Which reward function scores the task (see `envs.rewards`), with its parameters."""

    name: str = "exact_match"
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"RewardSpec.name={self.name!r} is invalid: a registered reward name")
        if not isinstance(self.params, Mapping):
            raise ValueError(f"RewardSpec.params={self.params!r} is invalid: a mapping")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RewardSpec:
        data = data or {}
        unknown = set(data) - {"name", "params"}
        if unknown:
            raise ValueError(f"unknown reward key(s) {sorted(unknown)}: allowed name, params")
        return cls(name=data.get("name", "exact_match"), params=dict(data.get("params") or {}))


@dataclass(frozen=True)
class Task:
    """One thing for the agent to do."""

    id: str
    """Unique within a suite; appears in trajectories and reports."""
    instruction: str
    """What the agent is told (the terminal env wraps it in the prompt template)."""
    setup: TaskSetup = field(default_factory=TaskSetup)
    """Files and commands the shell prepares before the first turn."""
    reward: RewardSpec = field(default_factory=RewardSpec)
    family: str = ""
    """Task family (`textops`, `swe`, ...), for grouping in reports."""
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"Task.id={self.id!r} is invalid: a non-empty string")
        if not isinstance(self.instruction, str) or not self.instruction.strip():
            raise ValueError(f"Task.instruction of {self.id!r} is invalid: a non-empty string")

    @property
    def kind(self) -> str:
        """What reports group by: the operation (`reward.params.op`, e.g. a textops
        operation), else the family."""
        op = self.reward.params.get("op") if self.reward is not None else None
        return str(op or self.family or "task")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "instruction": self.instruction,
            "family": self.family,
            "setup": self.setup.to_dict(),
            "reward": self.reward.to_dict(),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Task:
        if not isinstance(data, Mapping):
            raise ValueError(f"a task must be a JSON object, got {data!r}")
        unknown = [k for k in data if k not in _TASK_KEYS]
        if unknown:
            raise ValueError(f"unknown task key(s) {unknown}: allowed {list(_TASK_KEYS)}")
        for key in ("id", "instruction"):
            if key not in data:
                raise ValueError(f"task is missing '{key}'")
        return cls(
            id=data["id"],
            instruction=data["instruction"],
            family=data.get("family", ""),
            setup=TaskSetup.from_dict(data.get("setup")),
            reward=RewardSpec.from_dict(data.get("reward")),
            metadata=dict(data.get("metadata") or {}),
        )


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Tasks from a JSONL file; errors name the file and line."""
    tasks: list[Task] = []
    seen: set[str] = set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                task = Task.from_dict(json.loads(line))
            except (json.JSONDecodeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
            if task.id in seen:
                raise ValueError(f"{path}:{lineno}: duplicate task id {task.id!r}")
            seen.add(task.id)
            tasks.append(task)
    return tasks


def save_tasks(path: str | os.PathLike, tasks: Iterable[Task]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task.to_dict(), ensure_ascii=False) + "\n")
    return path


def is_heldout(task_id: str, fraction: float) -> bool:
    """A stable split by task id: the same task is on the same side in every job."""
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big") / 2**64
    return h < fraction
