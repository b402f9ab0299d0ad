"""Trainer checkpoints: Orbax CheckpointManager over the train state plus a JSON side item.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg)
    ckpt.save(step, trainer.state, extra={"data": iterator.get_state(), ...})
    state, extra = ckpt.restore(ckpt.latest_step(), trainer.abstract_state())

Layout: `checkpoints/<step>/state` (params, optimizer state, step, RNG: OCDBT, sharded arrays
written by each host's shards) and `checkpoints/<step>/extra` (JSON: the grain iterator
state, loop counters, the policy version). Saves are asynchronous by default; a checkpoint
only counts once Orbax has committed it, so a trainer killed mid-save resumes from the
previous one. Serving exports live beside, in `weights/v<version>/` (see `export_path`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rl.data.rundir import WEIGHTS
from rl.train.config import CheckpointConfig


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra")
        )

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, None when there is none."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, extra: dict | None = None, *, force: bool = False):
        """Start saving (returns once the arrays are copied off the device, unless async saving
        is off); True when a save was started."""
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardSave(state),
            extra=self._ocp.args.JsonSave(extra or {}),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, placed as `abstract_state`'s shardings say, and its extra."""
        if step not in self.manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} under {self.directory} (have {self.all_steps()})"
            )
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore(abstract_state),
            extra=self._ocp.args.JsonRestore(),
        )
        restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["extra"] or {})

    def wait(self) -> None:
        """Block until in-flight saves are committed."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_path(run_dir: str | os.PathLike, version: int) -> Path:
    """Where a trainer exports serving weights of policy version `version`."""
    return Path(run_dir).absolute() / WEIGHTS / f"v{version:06d}"
