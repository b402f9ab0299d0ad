"""`simloop widen`: a wider copy of trained serving weights that computes what they do.

    simloop widen configs/pretrained/sim-fileops --hidden-size 128 --head-dim 32 --out runs/sim-wide

Any of the residual width, the MLP width, the number of heads and the head width grows; every
added unit is either written by zero weights or read by them (`rl.model.widen`), so the wider
model's logits are the trained model's (to float32 rounding and the norms' epsilon). Fine-tune
it (`simloop train-sim --simulator.weights runs/sim-wide ...`) to put the added width to use.
Writes serving weights (`rl.model.params_io`: params, `model_config.json`, manifest) to `--out`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.config.schema import SimloopConfig
from launch.errors import UsageError

WIDTHS = ("hidden_size", "intermediate_size", "num_heads", "head_dim")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The widen flags; `--config` comes from the CLI itself (it is not read)."""
    p.add_argument("weights", metavar="WEIGHTS", help="a serving-weights directory")
    p.add_argument("--hidden-size", type=int, help="residual width (at least the model's)")
    p.add_argument("--intermediate-size", type=int, help="MLP width (at least the model's)")
    p.add_argument(
        "--num-heads",
        type=int,
        help="query heads (kv heads grow in proportion, so it must keep the group size)",
    )
    p.add_argument("--head-dim", type=int, help="per-head width: a whole multiple of the model's")
    p.add_argument("--seed", type=int, default=0, help="seed of the new units' random reads")
    p.add_argument("--out", metavar="DIR", required=True, help="where to write its weights")


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from flax import nnx

    from rl.model.loading import ModelSource, model_from_params
    from rl.model.params_io import read_model_config, save_params
    from rl.model.widen import widen

    src, out = Path(args.weights), Path(args.out)
    old = read_model_config(src)  # FileNotFoundError (exit 2) when it is not weights
    grow = {name: getattr(args, name) for name in WIDTHS if getattr(args, name) is not None}
    if not grow:
        raise UsageError(
            "widen needs at least one of --hidden-size, --intermediate-size, "
            "--num-heads, --head-dim"
        )
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty: choose a new directory")
    model = ModelSource(weights=str(src)).build(seed=0)
    try:
        params, new_cfg = widen(
            nnx.to_pure_dict(nnx.state(model, nnx.Param)), old, seed=args.seed, **grow
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    save_params(model_from_params(new_cfg, params), out)
    shape = ", ".join(f"{name} {getattr(old, name)} -> {getattr(new_cfg, name)}" for name in grow)
    print(f"simloop widen: {src} -> {out} ({shape}; the new units change nothing until trained)")
    return 0
