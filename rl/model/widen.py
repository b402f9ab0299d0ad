"""A wider model that computes what a trained one does: width expansion.

`widen(params, cfg, hidden_size=..., intermediate_size=..., num_heads=..., head_dim=...,
seed=...)` grows any of the four widths. Every added unit is either never written or never
read, so the logits stay the trained model's while the new units start learning at once:

- **Residual width** (`hidden_size`). The new residual dimensions are written by nothing: their
  embedding columns and the rows of attention's `o` and the MLP's `down` that reach them are
  zero, so they hold zero in every layer. The projections that read the residual (`q`, `k`,
  `v`, `gate`, `up`) get random rows for them, which multiply those zeros (the gradient that
  reaches a zero-write comes through these reads). An RMSNorm over D' dimensions of which D
  carry the old values divides by a mean square D/D' times the old one, so each norm weight
  is scaled by sqrt(D/D') to give back the old output (exact up to the norm's epsilon: the
  relative change is at most eps * (D'/D - 1) / mean square).
- **MLP width** (`intermediate_size`). New units: random `gate`/`up` columns, zero `down` rows.
- **Heads** (`num_heads`, with `num_kv_heads` grown in proportion so every group keeps its
  kv head). New heads: random `q`/`k`/`v`, zero `o` rows.
- **Head width** (`head_dim`, a whole multiple r of the old). RoPE rotates pair i of an H-dim
  head at theta^(-2i/H), and pair j of an H'-dim head at theta^(-2j/H'), so old pair i is new
  pair r*i: old dimension i goes to r*i and H/2+i to H'/2+r*i (rotate-half layout, as
  `rl.model.layers.rope`). The other new dimensions carry no signal: `o` reads them with zero
  rows, and their `q`/`k` columns are tiny (`SEED_SCALE` of the init range, which changes a
  score by about its square) so that gradients reach them; with zero on both sides a q·k
  product would have zero gradient for good. With qk-norm, the mean square over H' is H/H'
  times the old, and attention divides scores by sqrt(H') instead of sqrt(H): `k_norm`'s
  weight times sqrt(H/H') restores the keys, and the queries' larger norm cancels the larger
  divisor. Without qk-norm, `q`'s columns (and bias) are scaled by sqrt(H'/H) instead.

`simloop widen` (`launch.jobs.widen`) does it to a serving-weights directory; `deepen`
(`rl.model.deepen`) is the same idea for depth.
"""

from __future__ import annotations

import numpy as np

from rl.model.config import ModelConfig

SEED_SCALE = 1e-3
"""The new q/k head dimensions' weights, in units of the init range (see the module doc)."""


def head_dim_map(old: int, new: int) -> np.ndarray:
    """Where each of an old head's `old` dimensions goes in a `new`-dim head (RoPE pairs kept
    at their frequency). `new` must be a whole multiple of `old`."""
    if new < old or new % old or new % 2:
        raise ValueError(f"head_dim must be a whole multiple of the model's {old}; got {new}")
    r, half = new // old, old // 2
    i = np.arange(half)
    return np.concatenate([r * i, new // 2 + r * i])


def widen(
    params: dict,
    cfg: ModelConfig,
    *,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    head_dim: int | None = None,
    seed: int = 0,
) -> tuple[dict, ModelConfig]:
    """(the parameters of a wider model that computes what `params` does, its config).
    `params` is a pure dict (`nnx.to_pure_dict`) of a `rl.model.Qwen3` with stacked `layers`;
    a width left None keeps its value. Raises ValueError for a narrower width or a head_dim
    that is not a whole multiple of the old one."""
    D, F, N, K, H = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    D2 = D if hidden_size is None else hidden_size
    F2 = F if intermediate_size is None else intermediate_size
    N2 = N if num_heads is None else num_heads
    H2 = H if head_dim is None else head_dim
    for name, old, new in (
        ("hidden_size", D, D2),
        ("intermediate_size", F, F2),
        ("num_heads", N, N2),
    ):
        if new < old:
            raise ValueError(
                f"{name} must be at least the model's {old}; got {new}: widen only adds"
            )
    if N2 % (N // K):
        raise ValueError(
            f"num_heads {N2} must be a multiple of the model's {N // K} query heads per kv head"
        )
    K2 = N2 // (N // K)
    hmap = head_dim_map(H, H2)
    if "layers" not in params:
        raise ValueError("the parameters have no stacked `layers`: not a simloop decoder")

    rng = np.random.default_rng(seed)
    std = cfg.initializer_range

    def rand(shape, scale=1.0):
        return (scale * std * rng.standard_normal(shape)).astype(np.float32)

    norm_scale = np.sqrt(D / D2)
    L = cfg.num_layers
    lay = params["layers"]
    dt = np.asarray(params["embed"]).dtype

    def as_np(x):
        return np.asarray(x, np.float32)

    def residual_norm(w):  # [..., D] -> [..., D2]
        w = as_np(w) * norm_scale
        out = np.broadcast_to(w.mean(axis=-1, keepdims=True), (*w.shape[:-1], D2)).copy()
        out[..., :D] = w
        return out

    def reader(w, n_heads2, n_heads):  # [L, D, n, H] -> [L, D2, n2, H2]
        w = as_np(w)
        out = rand((L, D2, n_heads2, H2))
        if H2 > H:  # the new dims of the old heads: seeds only (module doc)
            keep = np.zeros(H2, bool)
            keep[hmap] = True
            out[:, :, :n_heads, ~keep] *= SEED_SCALE
        out[:, :D, :n_heads][..., hmap] = w
        return out

    attn = lay["attn"]
    q = reader(attn["q"], N2, N)
    k = reader(attn["k"], K2, K)
    v = rand((L, D2, K2, H2))
    v[:, :D, :K][..., hmap] = as_np(attn["v"])  # new v dims: read by zero o rows
    o = np.zeros((L, N2, H2, D2), np.float32)
    o_old = as_np(attn["o"])  # [L, N, H, D]
    o_sub = np.zeros((L, N, H2, D), np.float32)
    o_sub[:, :, hmap, :] = o_old
    o[:, :N, :, :D] = o_sub
    new_attn: dict = {"q": q, "k": k, "v": v, "o": o}
    if cfg.qk_norm:
        for name, factor in (("q_norm", 1.0), ("k_norm", np.sqrt(H / H2))):
            w = as_np(attn[name]["weight"])  # [L, H]
            out = np.broadcast_to(w.mean(axis=-1, keepdims=True), (L, H2)).copy()
            out[:, hmap] = w
            new_attn[name] = {"weight": out * factor}
    elif H2 > H:  # no norm: the larger score divisor is paid by q itself
        new_attn["q"] = q * np.sqrt(H2 / H)
    if cfg.qkv_bias:
        for name, heads2, heads, scale in (
            ("q_bias", N2, N, 1.0 if cfg.qk_norm else np.sqrt(H2 / H)),
            ("k_bias", K2, K, 1.0),
            ("v_bias", K2, K, 1.0),
        ):
            b = np.zeros((L, heads2, H2), np.float32)
            b[:, :heads][..., hmap] = as_np(attn[name])
            new_attn[name] = b * scale
    if cfg.o_bias:
        b = np.zeros((L, D2), np.float32)
        b[:, :D] = as_np(attn["o_bias"])
        new_attn["o_bias"] = b

    mlp = lay["mlp"]
    gate = rand((L, D2, F2))
    gate[:, :D, :F] = as_np(mlp["gate"])
    up = rand((L, D2, F2))
    up[:, :D, :F] = as_np(mlp["up"])
    down = np.zeros((L, F2, D2), np.float32)
    down[:, :F, :D] = as_np(mlp["down"])

    embed = np.zeros((cfg.vocab_size, D2), np.float32)
    embed[:, :D] = as_np(params["embed"])
    out: dict = {
        "embed": embed,
        "layers": {
            "attn": new_attn,
            "attn_norm": {"weight": residual_norm(lay["attn_norm"]["weight"])},
            "mlp": {"gate": gate, "up": up, "down": down},
            "mlp_norm": {"weight": residual_norm(lay["mlp_norm"]["weight"])},
        },
        "final_norm": {"weight": residual_norm(params["final_norm"]["weight"])},
    }
    if params.get("lm_head") is not None:  # reads the final norm's new dims, which are zero
        head = rand((D2, cfg.vocab_size))
        head[:D] = as_np(params["lm_head"])
        out["lm_head"] = head

    def cast(tree):
        if isinstance(tree, dict):
            return {name: cast(x) for name, x in tree.items()}
        return tree.astype(dt)

    return cast(out), cfg.replace(
        hidden_size=D2, intermediate_size=F2, num_heads=N2, num_kv_heads=K2, head_dim=H2
    )
