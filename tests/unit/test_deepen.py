"""`simloop deepen` (`rl.model.deepen`): a deeper model whose new blocks pass their input
through, so it computes what the trained one does, and which then trains like any other."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from launch.cli import main
from rl.model import Qwen3, tiny
from rl.model.deepen import expansion
from rl.model.loading import ModelSource
from rl.model.params_io import read_model_config, save_params


@pytest.mark.parametrize(
    "old,new,plan",
    [
        (3, 3, [0, 1, 2]),
        (3, 6, [0, None, 1, None, 2, None]),
        (2, 5, [0, None, 1, None, None]),
        (3, 4, [0, 1, 2, None]),
    ],
)
def test_new_blocks_are_spread_among_the_old_ones(old, new, plan):
    assert expansion(old, new) == plan


def test_a_model_is_never_made_shallower():
    with pytest.raises(ValueError, match="at least the model's 3"):
        expansion(3, 2)


def test_the_deeper_model_computes_what_the_trained_one_does(tmp_path):
    model = Qwen3(tiny(), rngs=nnx.Rngs(7))
    save_params(model, tmp_path / "w")
    assert (
        main(["deepen", str(tmp_path / "w"), "--num-layers", "5", "--out", str(tmp_path / "d")])
        == 0
    )
    assert read_model_config(tmp_path / "d").num_layers == 5
    deeper = ModelSource(weights=str(tmp_path / "d")).build(seed=0)
    tokens = np.random.default_rng(0).integers(0, 512, size=(2, 24)).astype(np.int32)
    want, got = np.asarray(model(tokens)), np.asarray(deeper(tokens))
    # The new blocks add attn @ 0 and mlp @ 0, exactly 0, so the old blocks see the very
    # inputs they saw before: any difference is XLA reassociating a float32 sum of the same
    # terms (at most ~n * 2^-24 relative for n <= 128 terms: 128 * 6e-8 < 1e-5).
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    # and the copies are real blocks: their inputs to the zeroed projections are the block's
    flat = dict(nnx.to_flat_state(nnx.state(deeper, nnx.Param)))
    o = np.asarray(flat[("layers", "attn", "o")].get_value())
    q = np.asarray(flat[("layers", "attn", "q")].get_value())
    assert not o[1].any() and o[0].any() and np.array_equal(q[1], q[0])


def test_deepen_errors_name_the_problem(tmp_path, capsys):
    save_params(Qwen3(tiny(), rngs=nnx.Rngs(0)), tmp_path / "w")
    assert (
        main(["deepen", str(tmp_path / "w"), "--num-layers", "1", "--out", str(tmp_path / "d")])
        == 2
    )
    assert "fewer than the 2 blocks" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert (
        main(["deepen", str(tmp_path / "w"), "--num-layers", "3", "--out", str(tmp_path / "full")])
        == 2
    )
    assert "is not empty" in capsys.readouterr().err
    assert (
        main(["deepen", str(tmp_path / "nope"), "--num-layers", "3", "--out", str(tmp_path / "e")])
        == 2
    )
    assert "not a simloop params checkpoint" in capsys.readouterr().err
