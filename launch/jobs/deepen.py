"""`simloop deepen`: a deeper copy of trained serving weights that computes what they do.

    simloop deepen configs/pretrained/sim-fileops --num-layers 6 --out runs/sim-deep

New blocks are inserted evenly among the old ones, each a copy of the block before it with
its output projections zeroed (`rl.model.deepen`), so the deeper model's logits equal the
trained model's; fine-tune it (`simloop train-sim --simulator.weights runs/sim-deep ...`) to
put the added capacity to use. Writes serving weights (`rl.model.params_io`: params,
`model_config.json`, manifest) into `--out`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch.config.schema import SimloopConfig
from launch.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The deepen flags; `--config` comes from the CLI itself (it is not read)."""
    p.add_argument("weights", metavar="WEIGHTS", help="a serving-weights directory")
    p.add_argument("--num-layers", type=int, required=True, help="blocks of the deeper model")
    p.add_argument("--out", metavar="DIR", required=True, help="where to write its weights")


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    from flax import nnx

    from rl.model.deepen import deepen
    from rl.model.loading import ModelSource, model_from_params
    from rl.model.params_io import read_model_config, save_params

    src, out = Path(args.weights), Path(args.out)
    old = read_model_config(src)  # FileNotFoundError (exit 2) when it is not weights
    if args.num_layers < old.num_layers:
        raise UsageError(
            f"--num-layers {args.num_layers} is fewer than the {old.num_layers} blocks of "
            f"{src}: deepen only adds blocks"
        )
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} is not empty: choose a new directory")
    model = ModelSource(weights=str(src)).build(seed=0)
    params, new_cfg = deepen(nnx.to_pure_dict(nnx.state(model, nnx.Param)), old, args.num_layers)
    save_params(model_from_params(new_cfg, params), out)
    print(
        f"simloop deepen: {src} ({old.num_layers} blocks) -> {out} ({args.num_layers} blocks; "
        f"the new ones pass their input through until trained)"
    )
    return 0
