"""Building a role's trainer from its config (`RoleConfig`: architecture, HF checkpoint or
serving weights, read by `rl.model.loading` as servers read them; sub-mesh) and exporting what
it trained: what `simloop train-sim` and `simloop train-agent` share.

    trainer = build_trainer(cfg.simulator, tok, optim=..., steps=..., loss="sft",
                            rules=cfg.sharding.rules, seed=cfg.run.seed, device_ids=ids)
    export_weights(trainer, run_dir, "final", ckpt_cfg)   # <run>/weights/final (+ -hf)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from rl.data.rundir import WEIGHTS
from rl.model.loading import ModelSource
from rl.train.config import CheckpointConfig, RoleConfig


def build_trainer(
    role: RoleConfig,
    tokenizer,
    *,
    optim,
    steps: int,
    loss: str,
    rules,
    seed: int,
    device_ids: Sequence[int] | None = None,
    loss_cfg=None,
    init_params=None,
    reference: bool = False,
):
    """The role's `Trainer` on its own sub-mesh (`device_ids`: the planned devices, None: the
    first ones), starting from `init_params` if given, else from the role's serving weights /
    HF checkpoint, else a random init."""
    from rl.train.mesh import role_meshes
    from rl.train.multihost import devices_at
    from rl.train.trainer import Trainer

    source = ModelSource.of_role(role)
    model_cfg, hf_params = source.trainer_start()
    params = hf_params if init_params is None else init_params
    # The plan numbers the job's devices 0..N-1 across all its processes.
    ids = None if device_ids is None else {"trainer": [d.id for d in devices_at(device_ids)]}
    mesh = role_meshes({"trainer": role.mesh}, device_ids=ids)
    check_spans_processes(mesh["trainer"])
    trainer = Trainer(
        model_cfg,
        optim,
        total_steps=steps,
        loss=loss,
        loss_cfg=loss_cfg,
        mesh=mesh["trainer"],
        rules=rules,
        # ids the sampler may draw, which the trainer must normalise over (serving's sampler)
        valid_vocab=min(model_cfg.vocab_size, tokenizer.vocab_size),
        seed=seed,
        init_params=params,
        reference=reference,
    )
    if params is None and source.weights is not None:
        # Orbax restores straight into the trainer's placement, so load after building it.
        trainer.reset_params(trainer.load_serving(source.weights))
    return trainer


def check_spans_processes(mesh) -> None:
    """ValueError unless every process of a multi-process job holds some of the trainer's
    devices: each runs the same steps, and one without a device of the mesh cannot."""
    import jax

    have = {d.process_index for d in mesh.devices.flat}
    missing = sorted(set(range(jax.process_count())) - have)
    if missing:
        ids = sorted(d.id for d in mesh.devices.flat)
        raise ValueError(
            f"the trainer's {mesh.devices.size} devices (JAX ids {ids}) lie on processes "
            f"{sorted(have)} only, so processes {missing} of this {jax.process_count()}-process "
            "job would have nothing to run: plan the trainer's role over every process's "
            "devices (chips.roles, the model's mesh) or run fewer processes (run.processes)"
        )


def export_weights(
    trainer,
    run_dir: str | Path,
    name: str,
    ckpt_cfg: CheckpointConfig,
    extra_files: Mapping[str, str] | None = None,
) -> Path:
    """Serving weights at `<run>/weights/<name>` (with `extra_files` beside them, sealed in
    their manifest; and an HF copy at `<name>-hf` when `export_hf`); returns the serving
    path."""
    out = Path(run_dir) / WEIGHTS
    path = trainer.export_serving(out / name, ckpt_cfg.export_dtype, extra_files)
    if ckpt_cfg.export_hf:
        trainer.export_hf(out / f"{name}-hf", ckpt_cfg.export_dtype)
    return path
