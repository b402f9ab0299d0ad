"""Checkpoints are verified before they are trusted (issue 17, "Checkpoints and runs").

Each damage a crash, a disk or a hostile user can do to a checkpoint (a flipped bit, a
truncated file, a deleted or torn metadata file, an empty newer step, a missing `state/`, a
symlink inside) makes resume skip that checkpoint, say why, and continue from the newest one
that verifies, training on bit for bit as if the damaged one had been deleted; non-finite
weights are never saved, loaded or served; a diverging loss stops the loop with the last good
checkpoint kept; a resumed loop logs every step once; a resumed RL run keeps its KL reference.
One tiny trainer is shared by the module (function-scoped views reset its state), and every
checkpoint is real Orbax output on disk.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.data.rundir import MetricsLog, read_metrics
from rl.model.config import tiny
from rl.model.integrity import MANIFEST, CheckpointError, verify_checkpoint
from rl.train.checkpoint import Checkpointer
from rl.train.config import CheckpointConfig, OptimConfig
from rl.train.loop import TrainingDiverged, resume, sft_loop
from rl.train.trainer import Trainer

VALID = 261
B, T = 8, 16
CFG = CheckpointConfig(async_save=False, keep=3)


def make_batch(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, VALID, (B, T + 1)).astype(np.int32)
    return {
        "tokens": seq[:, :-1],
        "targets": seq[:, 1:],
        "loss_mask": np.ones((B, T), np.int32),
        "segment_ids": np.ones((B, T), np.int32),
        "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
    }


class Batches:
    """An endless, checkpointable batch iterator (what a grain iterator offers the loop)."""

    def __init__(self, index: int = 0):
        self.index = index

    def __next__(self) -> dict:
        self.index += 1
        return make_batch(self.index)

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = state["index"]


@pytest.fixture(scope="module")
def shared():
    trainer = Trainer(
        tiny(),
        OptimConfig(lr=1e-3, warmup_steps=0),
        total_steps=50,
        loss="sft",
        valid_vocab=VALID,
        seed=0,
    )
    return trainer, jax.device_get(trainer.state)


@pytest.fixture
def trainer(shared):
    t, initial = shared
    t.state = jax.tree.map(lambda x, s: jax.device_put(np.array(x), s), initial, t.state_shardings)
    return t


def _largest_file(folder: Path) -> Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _flip_bit(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


DAMAGE = {
    "bit_flip_in_weights": (lambda d: _flip_bit(_largest_file(d / "state")), "sha256"),
    "truncated_file": (lambda d: _truncate(_largest_file(d / "state")), "truncated"),
    "deleted_METADATA": (lambda d: (d / "state" / "_METADATA").unlink(), "_METADATA is missing"),
    "torn_metadata_file": (lambda d: _truncate(d / "_CHECKPOINT_METADATA"), "truncated"),
    "missing_state_dir": (lambda d: shutil.rmtree(d / "state"), "missing"),
    "torn_manifest": (lambda d: _truncate(d / MANIFEST), "unreadable"),
    "extra_file": (lambda d: (d / "state" / "extra.bin").write_bytes(b"x"), "not in its"),
    "symlink_inside": (
        lambda d: (d / "state" / "escape").symlink_to("/etc/passwd"),
        "symlink",
    ),
}


def _two_checkpoints(trainer, folder: Path) -> tuple[dict, Checkpointer]:
    """Checkpoints at steps 1 and 2 (training between them); returns the host state at 1."""
    ckpt = Checkpointer(folder, CFG)
    trainer.step(make_batch(1))
    ckpt.save(1, trainer.state, {"data": {"index": 1}})
    at_1 = jax.device_get(trainer.state)
    trainer.step(make_batch(2))
    ckpt.save(2, trainer.state, {"data": {"index": 2}})
    ckpt.wait()
    return at_1, ckpt


def _poisoned(state: dict, factor: float) -> dict:
    """`state` with every parameter multiplied by `factor` (NaN or inf: a diverged run)."""
    return {**state, "params": jax.tree.map(lambda x: x * factor, state["params"])}


def _assert_state(state, host) -> None:
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_resume_skips_a_damaged_newest_checkpoint_and_says_why(trainer, tmp_path, capsys, case):
    damage, reason = DAMAGE[case]
    at_1, ckpt = _two_checkpoints(trainer, tmp_path / "ckpt")
    ckpt.close()
    damage(tmp_path / "ckpt" / "2")
    with pytest.raises(CheckpointError, match=reason):
        verify_checkpoint(tmp_path / "ckpt" / "2")
    batches = Batches()
    with Checkpointer(tmp_path / "ckpt", CFG) as again:
        extra = resume(trainer, again, batches)
        assert extra == {"data": {"index": 1}} and batches.index == 1
        _assert_state(trainer.state, at_1)
        # The damaged one is set aside (kept, not deleted) and out of the way of new saves.
        assert again.all_steps() == [1] and (tmp_path / "ckpt" / "2.rejected").is_dir()
        trainer.step(make_batch(2))
        again.save(2, trainer.state)
    err = capsys.readouterr().err
    assert "checkpoint step 2 skipped" in err and reason in err


def test_an_empty_newer_step_directory_is_skipped(trainer, tmp_path, capsys):
    at_1, ckpt = _two_checkpoints(trainer, tmp_path / "ckpt")
    ckpt.close()
    (tmp_path / "ckpt" / "7").mkdir()
    with Checkpointer(tmp_path / "ckpt", CFG) as again:
        assert resume(trainer, again)["data"] == {"index": 2}
    assert "checkpoint step 7 skipped" in capsys.readouterr().err


def _resume_and_train(trainer, run: Path, steps: int) -> tuple[int, dict[int, float], dict]:
    """Resume `run` into `trainer`, train to `steps` (a checkpoint every 2 steps, the
    rejected step's number saved again): the step resumed at, each step's loss, the state."""
    batches = Batches()
    with Checkpointer(run / "ckpt", CFG) as ckpt:
        resume(trainer, ckpt, batches)
        at = trainer.step_count
        sft_loop(
            trainer,
            batches,
            steps=steps,
            log=MetricsLog(run),
            ckpt=ckpt,
            ckpt_every=2,
            log_every=1,
            progress=False,
        )
    losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    return at, losses, jax.device_get(trainer.state)


@pytest.mark.parametrize("damage", ["bit_flip_in_weights", "unsealed_and_truncated"])
def test_a_fallback_resume_trains_exactly_as_a_plain_resume(trainer, tmp_path, capsys, damage):
    """Nothing of a rejected newest checkpoint reaches the run that falls back past it: not
    when only its hashes are read (sealed), nor when Orbax reads it before it is refused
    (unsealed), nor when the resumed run saves that step's number again and a later resume
    restores the new one. Losses and state equal a resume whose newest was deleted instead."""
    with Checkpointer(tmp_path / "fallback" / "ckpt", CFG) as ckpt:
        sft_loop(
            trainer,
            Batches(),
            steps=4,
            log=MetricsLog(tmp_path / "fallback"),
            ckpt=ckpt,
            ckpt_every=2,
            log_every=1,
            progress=False,
        )
    shutil.copytree(tmp_path / "fallback", tmp_path / "plain")
    newest = tmp_path / "fallback" / "ckpt" / "4"
    if damage == "unsealed_and_truncated":
        (newest / MANIFEST).unlink()
        _truncate(_largest_file(newest / "state"))
    else:
        DAMAGE[damage][0](newest)
    shutil.rmtree(tmp_path / "plain" / "ckpt" / "4")
    runs = {}
    for name in ("fallback", "plain"):
        runs[name] = _resume_and_train(trainer, tmp_path / name, 6)
    assert "checkpoint step 4 skipped" in capsys.readouterr().err
    assert (tmp_path / "fallback" / "ckpt" / "4.rejected").is_dir()
    for name in ("fallback", "plain"):  # a later resume from the step saved again
        shutil.rmtree(tmp_path / name / "ckpt" / "6")
        runs[f"{name}, again"] = _resume_and_train(trainer, tmp_path / name, 6)
    at, want, state = runs.pop("plain")
    assert at == 2 and sorted(want) == [1, 2, 3, 4, 5, 6]
    for name, (at, losses, other) in runs.items():
        assert at == (2 if name == "fallback" else 4), name
        assert losses == want, name  # bit for bit
        _assert_state(other, state)


def test_a_checkpoint_killed_before_its_manifest_is_read_back_in_full_then_sealed(
    trainer, tmp_path, capsys
):
    _, ckpt = _two_checkpoints(trainer, tmp_path / "ckpt")
    at_2 = jax.device_get(trainer.state)
    ckpt.close()
    (tmp_path / "ckpt" / "2" / MANIFEST).unlink()  # committed by Orbax, then SIGKILL
    with Checkpointer(tmp_path / "ckpt", CFG) as again:
        assert resume(trainer, again)["data"] == {"index": 2}
    _assert_state(trainer.state, at_2)
    assert "step 2 had no manifest" in capsys.readouterr().err
    verify_checkpoint(tmp_path / "ckpt" / "2")


def test_an_async_save_is_sealed_as_soon_as_it_commits(trainer, tmp_path):
    """No later save or close is needed: a trainer killed -9 while it trains on after an
    asynchronous save leaves that checkpoint sealed, not trusted on a read-back."""
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=True, keep=3))
    trainer.step(make_batch(1))
    assert ckpt.save(1, trainer.state, {"data": {"index": 1}})
    manifest = tmp_path / "ckpt" / "1" / MANIFEST
    deadline = time.monotonic() + 120  # the save of a tiny state commits in well under this
    while not manifest.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)  # the trainer touches nothing here: only the background sealer runs
    assert manifest.is_file(), "the committed checkpoint was not sealed in the background"
    verify_checkpoint(tmp_path / "ckpt" / "1")
    ckpt.close()


def test_a_failure_of_the_background_sealer_reaches_the_trainer(trainer, tmp_path, monkeypatch):
    import rl.train.checkpoint as checkpoint

    def broken(folder):
        raise OSError(f"disk full while sealing {folder}")

    monkeypatch.setattr(checkpoint, "write_manifest", broken)
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=True, keep=3))
    trainer.step(make_batch(1))
    ckpt.save(1, trainer.state, {"data": {"index": 1}})
    with pytest.raises(OSError, match="disk full while sealing"):
        ckpt.wait()
    monkeypatch.undo()
    ckpt.close()  # the step is sealed on this later call, the error reported once
    verify_checkpoint(tmp_path / "ckpt" / "1")


def test_a_checkpoint_without_manifest_is_still_confined(trainer, tmp_path, capsys):
    _, ckpt = _two_checkpoints(trainer, tmp_path / "ckpt")
    ckpt.close()
    (tmp_path / "ckpt" / "2" / MANIFEST).unlink()
    (tmp_path / "ckpt" / "2" / "state" / "escape").symlink_to("/etc/passwd")
    with Checkpointer(tmp_path / "ckpt", CFG) as again:
        assert resume(trainer, again)["data"] == {"index": 1}
    assert "symlink" in capsys.readouterr().err


def test_no_usable_checkpoint_is_a_clear_error(trainer, tmp_path):
    _, ckpt = _two_checkpoints(trainer, tmp_path / "ckpt")
    ckpt.close()
    for step in ("1", "2"):
        _flip_bit(_largest_file(tmp_path / "ckpt" / step / "state"))
    with Checkpointer(tmp_path / "ckpt", CFG) as again:
        with pytest.raises(CheckpointError, match=r"no checkpoint .* can be resumed from"):
            resume(trainer, again)
    # Both kept for inspection; a rerun starts over.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1.rejected", "2.rejected"]
    with Checkpointer(tmp_path / "ckpt", CFG) as fresh:
        assert resume(trainer, fresh) is None


def test_a_step_directory_linked_outside_the_root_is_refused(trainer, tmp_path):
    _, ckpt = _two_checkpoints(trainer, tmp_path / "elsewhere")
    ckpt.close()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "2").symlink_to(tmp_path / "elsewhere" / "2")
    with pytest.raises(CheckpointError, match="outside"):
        verify_checkpoint(root / "2", root=root)


def test_non_finite_state_is_never_saved_and_rotation_keeps_the_verified(trainer, tmp_path):
    cfg = CheckpointConfig(async_save=True, keep=1)
    with Checkpointer(tmp_path / "ckpt", cfg) as ckpt:
        for step in (1, 2):
            trainer.step(make_batch(step))
            ckpt.save(step, trainer.state)
        ckpt.wait()
        assert ckpt.all_steps() == [2]  # keep=1: the older sealed one rotated away
        poisoned = _poisoned(trainer.state, jnp.nan)
        with pytest.raises(CheckpointError, match=r"step 3 holds non-finite values"):
            ckpt.save(3, poisoned)
        ckpt.wait()
        assert ckpt.all_steps() == [2]
    verify_checkpoint(tmp_path / "ckpt" / "2")


def test_exported_weights_carry_a_manifest_and_nan_weights_are_refused(trainer, tmp_path):
    good = trainer.export_serving(tmp_path / "good")
    verify_checkpoint(good)
    trainer.load_serving(good, require_manifest=True)
    _flip_bit(_largest_file(good / "params"))
    with pytest.raises(CheckpointError, match="sha256"):
        trainer.load_serving(good)
    # NaN weights written by anything (a manifest does not vouch for the numbers) are refused.
    trainer.state = _poisoned(trainer.state, jnp.nan)
    bad = trainer.export_serving(tmp_path / "nan")
    with pytest.raises(CheckpointError, match="non-finite"):
        trainer.load_serving(bad)


# ----- the loops -------------------------------------------------------------------------------


def test_a_non_finite_loss_stops_training_and_keeps_the_last_checkpoint(trainer, tmp_path):
    log = MetricsLog(tmp_path)
    with Checkpointer(tmp_path / "ckpt", CFG) as ckpt:
        sft_loop(trainer, Batches(), steps=2, log=log, ckpt=ckpt, ckpt_every=2, progress=False)
        assert ckpt.all_steps() == [2]
        trainer.state = _poisoned(trainer.state, jnp.inf)
        stopped = r"loss is nan.* at step 3.*checkpoint is step 2"
        with pytest.raises(TrainingDiverged, match=stopped):
            sft_loop(
                trainer,
                Batches(2),
                steps=6,
                log=log,
                ckpt=ckpt,
                ckpt_every=1,
                log_every=5,
                progress=False,
            )
        assert ckpt.all_steps() == [2]
    verify_checkpoint(tmp_path / "ckpt" / "2")


def test_a_resumed_loop_logs_every_step_once_and_a_noop_rerun_reports_the_loss(
    trainer, shared, tmp_path
):
    log = MetricsLog(tmp_path)
    with Checkpointer(tmp_path / "ckpt", CFG) as ckpt:
        sft_loop(
            trainer,
            Batches(),
            steps=3,
            log=log,
            ckpt=ckpt,
            ckpt_every=2,
            log_every=1,
            progress=False,
        )
    # Killed after step 3 was logged, before its checkpoint: a torn line at the end too.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"stage": "sft", "ste')
    (tmp_path / "ckpt" / "3").rename(tmp_path / "gone")
    t, initial = shared
    t.state = jax.tree.map(lambda x, s: jax.device_put(np.array(x), s), initial, t.state_shardings)
    batches = Batches()
    with Checkpointer(tmp_path / "ckpt", CFG) as ckpt:
        resume(t, ckpt, batches)
        assert t.step_count == 2
        summary = sft_loop(
            t, batches, steps=4, log=log, ckpt=ckpt, ckpt_every=2, log_every=1, progress=False
        )
        rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "step" in r]
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        again = sft_loop(t, batches, steps=4, log=log, ckpt=ckpt, progress=False)
    assert again["started_at_step"] == 4
    assert again["last"]["loss"] == summary["last"]["loss"] and np.isfinite(again["last"]["loss"])


# ----- the KL reference of a resumed RL run ----------------------------------------------------


def test_resumed_rl_keeps_the_kl_reference_it_started_from(shared, tmp_path):
    from launch.config import load_config
    from launch.config.schema import SimloopConfig
    from launch.jobs.train_agent import session
    from rl.session import REFERENCE

    cfg = load_config(
        SimloopConfig,
        None,
        ["--train_agent.loss.kl_coef", "0.1", "--chips.roles", "{policy_train: 1}"],
    )
    run = session(cfg, tmp_path)
    # The warm-started policy (the agent is tiny() too): not what a rebuilt trainer starts
    # from (its seeded random init).
    warm = jax.tree.map(lambda x: np.asarray(x) + 0.5, shared[1]["params"])
    started = run._rl_trainer(warm, resuming=False)
    _assert_state(started.reference, warm)
    # The run is killed; the rerun rebuilds its trainer without the warm start.
    resumed = run._rl_trainer(None, resuming=True)
    _assert_state(resumed.reference, warm)
    assert not np.array_equal(
        np.asarray(jax.tree.leaves(resumed.params)[0]), np.asarray(jax.tree.leaves(warm)[0])
    )
    manifest = json.loads((tmp_path / "weights" / REFERENCE / MANIFEST).read_text())
    assert manifest["files"]
    # A damaged stored reference stops the resume instead of anchoring KL to something else.
    _flip_bit(_largest_file(tmp_path / "weights" / REFERENCE / "params"))
    with pytest.raises(CheckpointError, match="sha256"):
        run._rl_trainer(None, resuming=True)


# ----- the RL loop: a diverging step or a failed publish stops it --------------------------------


@pytest.fixture(scope="module")
def policy_trainer():
    from rl.train.config import PolicyLossConfig

    t = Trainer(
        tiny(),
        OptimConfig(lr=1e-3, warmup_steps=0),
        total_steps=10,
        loss="policy",
        loss_cfg=PolicyLossConfig(),
        valid_vocab=VALID,
        seed=0,
    )
    return t, jax.device_get(t.state)


def _rl(trainer, publisher, tmp_path, steps=3):
    """`steps` RL steps, each version published before the next step (no overlap: the
    overlapped loop's failures are tested in test_rl_publish_overlap.py)."""
    import asyncio

    from rl.train.config import PolicyLossConfig
    from rl.train.loop import rl_loop
    from rl.train.rollouts import InMemoryEpisodeSource
    from tests.unit.test_train_rollouts import make_traj

    source = InMemoryEpisodeSource(
        lambda v: [make_traj(reward=float(i % 2), group="g", gens=((4, v),)) for i in range(4)]
    )
    with Checkpointer(tmp_path / "ckpt", CFG) as ckpt:
        run = rl_loop(
            trainer,
            source,
            publisher,
            run_dir=tmp_path,
            steps=steps,
            rows=4,
            seq_len=16,
            loss_cfg=PolicyLossConfig(),
            pad_id=0,
            ckpt=ckpt,
            ckpt_every=1,
            overlap_publish=False,
            progress=False,
        )
        try:
            return asyncio.run(run)
        finally:
            ckpt.wait()
            source.steps_saved = ckpt.all_steps()


@pytest.mark.parametrize("failure", ["publish", "nan"])
def test_rl_stops_on_a_failed_publish_or_a_diverged_step(policy_trainer, tmp_path, failure):
    from rl.model.publish import InMemoryPublisher

    trainer, initial = policy_trainer
    trainer.state = jax.tree.map(
        lambda x, s: jax.device_put(np.array(x), s), initial, trainer.state_shardings
    )
    published = []

    def on_publish(path, version):
        if failure == "publish" and version == 3:
            raise OSError("the server refused version 3")
        published.append(version)

    if failure == "nan":  # the second step diverges
        _rl(trainer, InMemoryPublisher(on_publish=on_publish), tmp_path, steps=1)
        trainer.state = _poisoned(trainer.state, jnp.inf)
    error = OSError if failure == "publish" else TrainingDiverged
    with pytest.raises(error, match="version 3" if failure == "publish" else "at step 2"):
        _rl(trainer, InMemoryPublisher(on_publish=on_publish), tmp_path)
    # Nothing trained on past the failure, and the last checkpoint is the last good step.
    assert published == [2]
    assert trainer.step_count == 2
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [1]
