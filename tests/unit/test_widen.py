"""`simloop widen` (`rl.model.widen`): a wider model (residual, MLP, heads, head width) that
computes what the trained one does, whose new units then learn."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from launch.cli import main
from rl.model import Qwen3, tiny
from rl.model.loading import ModelSource
from rl.model.params_io import read_model_config, save_params
from rl.model.widen import head_dim_map, widen


def trained_like(cfg, seed):
    """A model whose every parameter, norms included, is random and away from its init: a
    widening that forgot a norm correction or a RoPE pair would show. Embeddings of trained
    scale (mean square ~0.1, as a trained simulator's common tokens)."""
    model = Qwen3(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    pure = jax.tree.map(
        lambda x: (
            np.asarray(x) * rng.uniform(0.5, 1.5, np.shape(x)).astype(np.float32)
            + 0.02 * rng.standard_normal(np.shape(x)).astype(np.float32)
        ),
        nnx.to_pure_dict(state),
    )
    pure["embed"] = pure["embed"] * 10
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def build(params, cfg):
    model = Qwen3(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def test_head_dims_keep_their_rope_frequency():
    # old pair i rotates at theta^(-2i/8); new pair 2i of a 16-dim head at theta^(-4i/16)
    assert head_dim_map(8, 16).tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    assert head_dim_map(4, 12).tolist() == [0, 3, 6, 9]
    with pytest.raises(ValueError, match="whole multiple of the model's 16"):
        head_dim_map(16, 24)


WIDENINGS = [
    dict(hidden_size=96),
    dict(intermediate_size=200),
    dict(num_heads=8),
    dict(head_dim=32),
    dict(hidden_size=128, intermediate_size=256, num_heads=8, head_dim=32),
]


CASES = [(grow, False) for grow in WIDENINGS] + [(WIDENINGS[-1], True)]  # Qwen2: all at once


@pytest.mark.parametrize(
    "grow,qwen2",
    CASES,
    ids=[",".join(f"{k}={v}" for k, v in g.items()) + ("-qwen2" if q else "") for g, q in CASES],
)
def test_the_wider_model_computes_what_the_trained_one_does(grow, qwen2):
    # eps ~0 here: the norms' epsilon is the one inexact term (module doc), bounded there and
    # checked with the real epsilon in the CLI test below
    cfg = tiny(rms_norm_eps=1e-12)
    if qwen2:
        cfg = cfg.replace(qk_norm=False, qkv_bias=True, tie_word_embeddings=False)
    model = trained_like(cfg, seed=3)
    params, cfg2 = widen(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, **grow)
    wider = build(params, cfg2)
    assert all(getattr(cfg2, k) == v for k, v in grow.items())
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 40)).astype(np.int32)
    want, got = np.asarray(model(tokens)), np.asarray(wider(tokens))
    # What may differ: float32 reassociation of the same nonzero terms (sums of n <= 256 terms
    # at 2^-24 each: < 2e-5 relative) and the seeded q/k head dims, whose products are
    # (1e-3 * 0.02 * 1.5)^2 * D ~ 1e-7 next to scores of order 1.
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * scale)


def test_widening_the_heads_keeps_groups_and_refuses_narrowing():
    cfg = tiny()  # 4 query heads on 2 kv heads
    params = nnx.to_pure_dict(nnx.state(Qwen3(cfg, rngs=nnx.Rngs(0)), nnx.Param))
    assert widen(params, cfg, num_heads=8)[1].num_kv_heads == 4
    with pytest.raises(ValueError, match="multiple of the model's 2 query heads"):
        widen(params, cfg, num_heads=7)
    with pytest.raises(ValueError, match="at least the model's 64"):
        widen(params, cfg, hidden_size=32)


def test_every_new_unit_gets_a_gradient():
    """Zero-written units must not be stuck: each new part moves on the first Adam step."""
    cfg = tiny()
    model = trained_like(cfg, seed=5)
    params, cfg2 = widen(
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
        cfg,
        hidden_size=96,
        intermediate_size=160,
        num_heads=8,
        head_dim=32,
    )
    wider = build(params, cfg2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 512, size=(2, 33)), jnp.int32)

    def loss_fn(m):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    grads = nnx.to_pure_dict(nnx.grad(loss_fn)(wider))
    g = jax.tree.map(np.asarray, grads)
    new_dims = np.setdiff1d(np.arange(32), head_dim_map(16, 32))
    parts = {
        "embed's new columns": g["embed"][:, 64:],
        "o's rows of new heads": g["layers"]["attn"]["o"][:, 4:],
        "o's rows of new head dims": g["layers"]["attn"]["o"][:, :4, new_dims],
        "o's new residual columns": g["layers"]["attn"]["o"][..., 64:],
        "down's new units": g["layers"]["mlp"]["down"][:, 128:],
        "down's new residual columns": g["layers"]["mlp"]["down"][..., 64:],
        "q's new head dims": g["layers"]["attn"]["q"][:, :, :4, new_dims],
        "k's new head dims": g["layers"]["attn"]["k"][:, :, :2, new_dims],
    }
    for name, grad in parts.items():
        assert np.abs(grad).max() > 0, f"{name} get no gradient"


def test_simloop_widen_writes_serving_weights(tmp_path, capsys):
    model = trained_like(tiny(), seed=7)
    save_params(model, tmp_path / "w")
    argv = ["widen", str(tmp_path / "w"), "--hidden-size", "96", "--head-dim", "32"]
    assert main([*argv, "--out", str(tmp_path / "x")]) == 0
    cfg = read_model_config(tmp_path / "x")
    assert (cfg.hidden_size, cfg.head_dim) == (96, 32)
    wider = ModelSource(weights=str(tmp_path / "x")).build(seed=0)
    tokens = np.arange(24, dtype=np.int32).reshape(2, 12)
    want = np.asarray(model(tokens))
    # the real epsilon (1e-6) now: it moves a norm's output by at most eps * (D'/D - 1) / (2 *
    # mean square) relative, < 1e-5 at these embeddings' mean squares (>= ~0.03)
    np.testing.assert_allclose(
        np.asarray(wider(tokens)), want, rtol=1e-4, atol=1e-4 * np.abs(want).max()
    )
    # errors name the flag and what is allowed, without a traceback
    assert main([*argv[:2], "--head-dim", "24", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "head_dim must be a whole multiple of the model's 16" in err and "Traceback" not in err
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    assert "not empty" in capsys.readouterr().err
