"""Trainer checkpoints: Orbax CheckpointManager over the train state plus a JSON side item,
each sealed by a manifest (`rl.model.integrity`) and verified before it is trusted.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg)
    ckpt.save(step, trainer.state, extra={"data": iterator.get_state(), ...})
    found = ckpt.restore_latest(trainer.abstract_state())   # newest checkpoint that verifies

Layout: `checkpoints/<step>/state` (params, optimizer state, step, RNG: OCDBT, sharded arrays
written by each host's shards), `checkpoints/<step>/extra` (JSON: the grain iterator state,
loop counters, the policy version) and `checkpoints/<step>/manifest.json` (size and sha256 of
every file). Saves are asynchronous by default; a checkpoint only counts once Orbax has
committed it and its manifest is written, so a trainer killed mid-save resumes from the
previous one. A background thread seals each asynchronous save the moment Orbax commits it
(not at the next save), so a kill leaves an unsealed committed checkpoint only if it lands
between Orbax's commit and the manifest's write, a few milliseconds. Such a checkpoint is
trusted only if it reads back completely and finite; it is sealed then.
A state holding NaN or inf is never saved. Rotation keeps the newest `keep`
sealed checkpoints and deletes only older ones: the newest verified checkpoint is never
deleted. A checkpoint that fails verification at resume is moved aside to
`<step>.rejected[-n]` (kept for inspection, out of Orbax's way). Serving exports live beside,
in `weights/v<version>/` (see `export_path`).

With several JAX processes (`rl.train.multihost`) every process calls save and restore
together: Orbax writes each process's shards, process 0 alone writes manifests and moves
rejected checkpoints aside, and barriers keep the others from reading before it has (sealing is
then done at the next save or wait, not on a background thread).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any, NamedTuple

from rl.data.rundir import WEIGHTS
from rl.model.integrity import (
    MANIFEST,
    CheckpointError,
    ManifestMissing,
    check_confined,
    check_finite,
    verify_checkpoint,
    write_manifest,
)
from rl.train import multihost
from rl.train.config import CheckpointConfig


class Restored(NamedTuple):
    """What `restore_latest` found: the step, its state and extra, the newer (or
    unreadable) checkpoints it skipped as `(step, reason)`, and whether the step had to be
    sealed on restore (committed, then killed before its manifest was written)."""

    step: int
    state: Any
    extra: dict
    skipped: list[tuple[int, str]]
    sealed_now: bool = False


class Checkpointer:
    def __init__(self, directory: str | os.PathLike, cfg: CheckpointConfig):
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            # Rotation is ours (`_seal`): Orbax's would delete old checkpoints before the new
            # one is known to be sound.
            max_to_keep=None,
            enable_async_checkpointing=cfg.async_save,
            create=True,
            # Orbax 0.12 creates a save's directories in the background by default, beside
            # the array writes; under a loaded CPU a write once made the item's directory
            # first, and the creation then took it for a leftover and deleted it under the
            # writer ("Directory not empty", a failed save; 2026-12-06). Made in `save`, they
            # cost a few mkdirs.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        self._ocp = ocp
        self._unsealed: list[int] = []
        # The thread sealing the asynchronous save in flight, and what it raised: the save's
        # own error (Orbax re-raises it from `wait_until_finished`) reaches the trainer at its
        # next call here. Only this thread and the trainer's own calls touch the manager, and
        # every trainer call joins the thread first.
        self._sealer: threading.Thread | None = None
        self._sealer_error: BaseException | None = None
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "extra")
        )

    def latest_step(self) -> int | None:
        """The newest committed checkpoint's step, None when there is none."""
        self._join_sealer()
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        self._join_sealer()
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, step: int, state: Any, extra: dict | None = None, *, force: bool = False):
        """Start saving (returns once the arrays are copied off the device, unless async saving
        is off); True when a save was started. Raises CheckpointError (saving nothing) when the
        state holds NaN or inf."""
        check_finite(state, f"the train state at step {step}")
        self._seal()  # the previous save is committed before Orbax starts this one anyway
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardSave(state),
            extra=self._ocp.args.JsonSave(extra or {}),
        )
        started = self.manager.save(step, args=args, force=force)
        if started:
            self._unsealed.append(step)
            # With several processes an asynchronous save is sealed at the next save or wait,
            # all processes together (barriers), not on a thread.
            if self.cfg.async_save and multihost.process_count() == 1:
                self._sealer = threading.Thread(
                    target=self._seal_in_background, name=f"seal-checkpoint-{step}", daemon=True
                )
                self._sealer.start()
            elif not self.cfg.async_save:
                self._seal()
        return started

    def _seal_in_background(self) -> None:
        try:
            self._seal_committed()
        except BaseException as e:  # handed to the trainer by `_join_sealer`
            self._sealer_error = e

    def _join_sealer(self) -> None:
        """Wait for the background sealer, and raise what it raised."""
        if self._sealer is not None:
            self._sealer.join()
            self._sealer = None
        error, self._sealer_error = self._sealer_error, None
        if error is not None:
            raise error

    def _seal(self) -> None:
        """Wait for in-flight saves and seal them (see `_seal_committed`)."""
        self._join_sealer()
        self._seal_committed()

    def _seal_committed(self) -> None:
        """Wait for in-flight saves, write the manifest of each newly committed checkpoint,
        then drop all but the newest `keep` sealed ones."""
        self.manager.wait_until_finished()
        if not self._unsealed:
            return
        committed = set(self.manager.all_steps())
        for step in self._unsealed:
            if step in committed and multihost.is_primary():
                write_manifest(self.step_dir(step))
        self._unsealed = []
        multihost.barrier("simloop checkpoint sealed")  # every process sees the manifests
        steps = sorted(self.manager.all_steps())
        sealed = [s for s in steps if (self.step_dir(s) / MANIFEST).is_file()]
        if multihost.process_count() == 1:
            for step in sealed[: -self.cfg.keep]:
                self.manager.delete(step)
            return
        # Several processes: process 0 decides and deletes, the others re-read the directory.
        # (Orbax's own delete makes every process name the same step at once; one that
        # resumed from a checkpoint process 0 sealed then could list it differently.)
        if multihost.is_primary():
            for step in sealed[: -self.cfg.keep]:
                shutil.rmtree(self.step_dir(step))
        multihost.barrier("simloop checkpoints rotated")
        self.manager.reload()

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, placed as `abstract_state`'s shardings say, and its extra,
        after verifying the checkpoint's files; CheckpointError when it does not verify,
        cannot be read or holds non-finite values."""
        state, extra, _ = self._restore(step, abstract_state)
        return state, extra

    def _restore(self, step: int, abstract_state: Any) -> tuple[Any, dict, bool]:
        """`restore`, and whether the checkpoint had no manifest and was sealed now: every
        array read back (Orbax checks shapes and the OCDBT structure) and finite."""
        self._seal()  # a save of this trainer still in flight counts once it is sealed
        if step not in self.manager.all_steps():
            have = sorted(self.manager.all_steps())
            raise FileNotFoundError(
                f"no checkpoint for step {step} under {self.directory} (have {have})"
            )
        where = self.step_dir(step)
        try:
            verify_checkpoint(where, root=self.directory)
            unsealed = False
        except ManifestMissing:
            check_confined(where, root=self.directory)
            unsealed = True  # read back in full below; sealed only if that succeeds
        args = self._ocp.args.Composite(
            state=self._ocp.args.StandardRestore(abstract_state),
            extra=self._ocp.args.JsonRestore(),
        )
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as e:  # Orbax raises many types for unreadable data; name them
            raise CheckpointError(
                f"checkpoint {where} cannot be read: {type(e).__name__}: {e}"
            ) from e
        state = restored["state"]
        check_finite(state, f"checkpoint {where}")
        if unsealed and multihost.is_primary():
            write_manifest(where)
        return state, dict(restored["extra"] or {}), unsealed

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that verifies and restores (None when the directory holds no
        step at all). Those skipped on the way are moved aside and listed with the reason;
        CheckpointError when step directories exist but none of them is usable."""
        on_disk = sorted(
            (int(p.name) for p in self.directory.iterdir() if p.name.isdigit()), reverse=True
        )
        multihost.barrier("simloop checkpoints listed")  # before process 0 moves any aside
        skipped: list[tuple[int, str]] = []
        found = None
        for step in on_disk:
            try:
                state, extra, sealed_now = self._restore(step, abstract_state)
            except (CheckpointError, FileNotFoundError) as e:
                skipped.append((step, str(e)))
                continue
            found = Restored(step, state, extra, skipped, sealed_now)
            break
        multihost.barrier("simloop checkpoints read")  # no process still reads what moves
        self._set_aside([s for s, _ in skipped])
        if found is None and skipped:
            reasons = "; ".join(f"step {s}: {why}" for s, why in skipped)
            raise CheckpointError(
                f"no checkpoint under {self.directory} can be resumed from ({reasons}); they "
                "were moved aside as <step>.rejected: run again to start over"
            )
        return found

    def _set_aside(self, steps: list[int]) -> None:
        for step in steps if multihost.is_primary() else ():
            src = self.step_dir(step)
            dst, n = self.directory / f"{step}.rejected", 1
            while dst.exists() or dst.is_symlink():
                dst, n = self.directory / f"{step}.rejected-{n}", n + 1
            os.replace(src, dst)
        if steps:
            multihost.barrier("simloop checkpoints set aside")
            self.manager.reload()

    def wait(self) -> None:
        """Block until in-flight saves are committed and sealed."""
        self._seal()

    def close(self) -> None:
        self._seal()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_path(run_dir: str | os.PathLike, version: int) -> Path:
    """Where a trainer exports serving weights of policy version `version`."""
    return Path(run_dir).absolute() / WEIGHTS / f"v{version:06d}"
