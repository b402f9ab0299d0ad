"""rl/train core: optimizer schedule, device splitting, the Trainer and its checkpoints.

Trainers on the tiny model are shared through module-scoped fixtures (each one costs a few
seconds of compilation on CPU). A test never sees what another test did to them: it gets a
shared trainer through a function-scoped fixture that puts the trainer's state back to the one
its reference run left (before and after the test), and the run's metrics and state are
read-only host copies. Tests pass in any order (`pytest -p randomly` shuffles them).
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from rl.model.config import MeshConfig, tiny
from rl.model.params_io import load_params, read_model_config
from rl.model.transformer import Qwen3
from rl.train.checkpoint import Checkpointer, export_path
from rl.train.config import CheckpointConfig, OptimConfig, PolicyLossConfig
from rl.train.losses import mask_vocab
from rl.train.mesh import (
    batch_sharding,
    data_parallel_size,
    role_meshes,
    split_devices,
)
from rl.train.optim import lr_schedule, make_optimizer
from rl.train.trainer import Trainer

VALID = 261
B, T = 8, 32
MASKED_PER_ROW = 16
TOTAL = 40
MODEL = tiny()
OPT = OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.01, clip_norm=1.0)
REF_STEPS = 5
EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: twice float32's unit roundoff u = 2^-24


def f32_mean_tolerance(terms):
    """How far a float32 mean of `terms` (however XLA orders the sum) may be from the exact mean
    of the same terms: n * eps32 * mean(|terms|) = 2 n u * mean(|terms|), n = terms.size.

    - Summing n terms in any order (one pass, pairwise, per micro-batch and then combined)
      is off by at most (n - 1) u * sum(|terms|), to first order in u (Higham, Accuracy and
      Stability of Numerical Algorithms, 2nd ed., section 4.2); the division by n and the
      grad-accumulation re-weighting add a few u more. That is the first n u.
    - The second n u covers each term's own rounding on the device, at most n u relative to
      it: a few u from exp and the products, and the logp that the step's program recomputes,
      which may differ from the output of `trainer.logprobs` (another program) in its last
      bits: n u = 7.6e-6 nats for n = 128 is 16 ulp of a logprob of size < 8.

    The bound scales with the sum of |terms|, not with the result: a mean of terms that cancel
    (advantages of both signs) is much smaller than its rounding error allows for relative to
    itself, so an rtol on the result would only pass on machines that happen to round the same.
    """
    terms = np.asarray(terms, np.float64)
    return terms.size * EPS32 * np.abs(terms).mean()


def read_only(tree):
    """Host copies that a test cannot change by accident (numpy raises on writes)."""

    def freeze(x):
        x = np.array(x)  # a copy: never a view of a device buffer a later step may donate
        x.setflags(write=False)
        return x

    return jax.tree.map(freeze, tree)


# ----- config validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: OptimConfig(lr=0.0), "OptimConfig.lr"),
        (lambda: OptimConfig(grad_accum=0), "OptimConfig.grad_accum"),
        (lambda: OptimConfig(min_lr_ratio=1.5), "OptimConfig.min_lr_ratio"),
        (lambda: OptimConfig(b2=1.0), "OptimConfig.b2"),
        (lambda: OptimConfig(clip_norm=0.0), "OptimConfig.clip_norm"),
        (lambda: PolicyLossConfig(advantage="ppo"), "PolicyLossConfig.advantage"),
        (lambda: PolicyLossConfig(aggregation="sum"), "PolicyLossConfig.aggregation"),
        (lambda: PolicyLossConfig(eps_low=1.0), "PolicyLossConfig.eps_low"),
        (lambda: PolicyLossConfig(tis_cap=0.5), "PolicyLossConfig.tis_cap"),
        (lambda: PolicyLossConfig(kl_coef=-0.1), "PolicyLossConfig.kl_coef"),
        (lambda: CheckpointConfig(keep=0), "CheckpointConfig.keep"),
        (lambda: CheckpointConfig(export_dtype="int8"), "CheckpointConfig.export_dtype"),
    ],
)
def test_configs_reject_bad_values_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


# ----- lr schedule and optimizer ---------------------------------------------------------------


def ref_lr(step, lr, warmup, decay, ratio):
    if step < warmup:
        return lr * step / warmup
    k = min(step - warmup, decay)
    return lr * (ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * k / decay)))


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    cfg = OptimConfig(lr=2.0, warmup_steps=10, min_lr_ratio=0.1)
    s = lr_schedule(cfg, total_steps=110)  # decay over the 100 steps after warmup
    assert float(s(0)) == 0.0
    np.testing.assert_allclose(float(s(5)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(s(10)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), 2.0 * 0.55, rtol=1e-6)  # half-way down the cosine
    np.testing.assert_allclose(float(s(110)), 0.2, rtol=1e-5)
    np.testing.assert_allclose(float(s(500)), 0.2, rtol=1e-5)  # flat after
    for step in range(0, 130, 3):
        np.testing.assert_allclose(
            float(s(step)), ref_lr(step, 2.0, 10, 100, 0.1), rtol=1e-5, err_msg=str(step)
        )


def test_lr_schedule_without_warmup_and_with_explicit_decay_steps():
    s = lr_schedule(OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0), total_steps=20)
    assert float(s(0)) == 1.0
    np.testing.assert_allclose(float(s(10)), 0.5, rtol=1e-6)
    assert abs(float(s(20))) < 1e-7
    cfg = OptimConfig(lr=1.0, warmup_steps=4, decay_steps=8, min_lr_ratio=0.25)
    s = lr_schedule(cfg, total_steps=1000)  # decay_steps wins over total_steps
    for step in range(0, 20):
        np.testing.assert_allclose(float(s(step)), ref_lr(step, 1.0, 4, 8, 0.25), rtol=1e-5)
    np.testing.assert_allclose(float(s(12)), 0.25, rtol=1e-6)


def _mu(opt_state):
    return optax.tree_utils.tree_get(opt_state, "mu")


def test_optimizer_clips_by_global_norm():
    params = {"w": jnp.zeros(4), "v": jnp.zeros(2)}
    grads = {"w": jnp.asarray([3e3, 0.0, 4e3, 0.0]), "v": jnp.asarray([0.0, 0.0])}  # norm 5e3
    cfg = OptimConfig(lr=1e-2, warmup_steps=0, clip_norm=2.0, b1=0.9)
    opt = make_optimizer(cfg, total_steps=10)
    _, state = opt.update(grads, opt.init(params), params)
    # Adam's first moment sees the clipped gradient: (1 - b1) * g * 2 / 5e3.
    np.testing.assert_allclose(
        np.asarray(_mu(state)["w"]), 0.1 * np.asarray([1.2, 0, 1.6, 0]), rtol=1e-6
    )
    # A gradient under the threshold passes untouched, and clip_norm=None never clips.
    small = {"w": jnp.asarray([0.3, 0.0, 0.4, 0.0]), "v": jnp.zeros(2)}
    _, state = opt.update(small, opt.init(params), params)
    np.testing.assert_allclose(np.asarray(_mu(state)["w"]), 0.1 * np.asarray(small["w"]), rtol=1e-6)
    opt_none = make_optimizer(OptimConfig(lr=1e-2, warmup_steps=0, clip_norm=None), 10)
    _, state = opt_none.update(grads, opt_none.init(params), params)
    np.testing.assert_allclose(np.asarray(_mu(state)["w"]), 0.1 * np.asarray(grads["w"]), rtol=1e-6)


def test_weight_decay_skips_norm_weights_of_the_real_model():
    abstract = nnx.eval_shape(lambda: Qwen3(MODEL, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(np.float32),
        nnx.to_pure_dict(nnx.state(abstract, nnx.Param)),
    )
    cfg = OptimConfig(lr=0.5, warmup_steps=0, weight_decay=0.1)
    opt = make_optimizer(cfg, total_steps=10)
    zeros = jax.tree.map(np.zeros_like, params)
    updates, _ = jax.jit(lambda g, p: opt.update(g, opt.init(p), p))(zeros, params)
    decayed, skipped = [], []
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = "/".join(str(k.key) for k in path)
        p = _get(params, path)
        if "norm" in name:
            skipped.append(name)
            assert not np.asarray(u).any(), name
        else:
            decayed.append(name)
            # zero gradient: the update is the decoupled decay alone, -lr * wd * p
            np.testing.assert_allclose(
                np.asarray(u), -0.05 * np.asarray(p), rtol=1e-6, err_msg=name
            )
    assert {
        "final_norm/weight",
        "layers/attn/q_norm/weight",
        "layers/attn/k_norm/weight",
        "layers/attn_norm/weight",
        "layers/mlp_norm/weight",
    } == set(skipped)
    assert {"embed", "layers/mlp/up", "layers/attn/q"} <= set(decayed)


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


# ----- device splitting ------------------------------------------------------------------------


def test_split_devices_hands_out_disjoint_blocks_in_order():
    devs = jax.devices()
    assert len(devs) == 8, "conftest fakes 8 CPU devices"
    out = split_devices({"policy": 2, "sim": 4, "ref": 1})
    assert out == {"policy": devs[0:2], "sim": devs[2:6], "ref": devs[6:7]}
    out = split_devices({"a": 3, "b": 2}, devs[3:])  # an explicit device list
    assert out == {"a": devs[3:6], "b": devs[6:8]}


def test_split_devices_honours_explicit_ids_and_fills_the_rest_around_them():
    devs = jax.devices()
    out = split_devices({"a": 2, "b": 4, "c": 2}, device_ids={"b": [1, 3, 5, 7]})
    assert out["b"] == [devs[i] for i in (1, 3, 5, 7)]
    assert out["a"] == [devs[0], devs[2]] and out["c"] == [devs[4], devs[6]]
    ids = [d.id for role in out.values() for d in role]
    assert sorted(ids) == list(range(8))


def test_split_devices_errors_are_specific():
    with pytest.raises(ValueError, match=r"device 2 is given to both 'a' and 'b'"):
        split_devices({"a": 2, "b": 2}, device_ids={"a": [1, 2], "b": [2, 3]})
    with pytest.raises(ValueError) as e:
        split_devices({"policy": 4, "sim": 4, "ref": 2})
    msg = str(e.value)
    assert "'ref' needs 2 devices but only 0 are left" in msg
    assert "= 10 devices" in msg and "has 8" in msg and "shrink" in msg
    with pytest.raises(ValueError, match=r"role 'a': device id 11 does not exist"):
        split_devices({"a": 1}, device_ids={"a": [11]})
    with pytest.raises(ValueError, match=r"role 'a': 3 device ids for a mesh of 2"):
        split_devices({"a": 2}, device_ids={"a": [0, 1, 2]})
    # Explicit ids take devices the free roles then cannot have.
    with pytest.raises(ValueError, match=r"'b' needs 7 devices but only 6 are left"):
        split_devices({"a": 2, "b": 7}, device_ids={"a": [0, 1]})


def test_role_meshes_are_named_disjoint_and_shaped():
    meshes = role_meshes(
        {"policy": MeshConfig(data=2, tensor=2), "sim": MeshConfig(fsdp=2), "ref": MeshConfig()}
    )
    assert meshes["policy"].axis_names == ("data", "fsdp", "tensor")
    assert dict(meshes["policy"].shape) == {"data": 2, "fsdp": 1, "tensor": 2}
    assert dict(meshes["sim"].shape) == {"data": 1, "fsdp": 2, "tensor": 1}
    devs = jax.devices()
    assert list(meshes["policy"].devices.flat) == devs[0:4]
    assert list(meshes["sim"].devices.flat) == devs[4:6]
    assert list(meshes["ref"].devices.flat) == devs[6:7]
    assert data_parallel_size(meshes["policy"]) == 2 and data_parallel_size(meshes["sim"]) == 2
    sharding = batch_sharding(meshes["policy"])
    assert sharding.spec == P(("data", "fsdp"), None)
    x = jax.device_put(np.zeros((4, 3), np.float32), sharding)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 3)}
    placed = role_meshes({"p": MeshConfig(tensor=2)}, device_ids={"p": [6, 7]})["p"]
    assert list(placed.devices.flat) == devs[6:8]
    with pytest.raises(ValueError, match="needs 4 devices but only 2 are left"):
        role_meshes({"a": MeshConfig(data=6), "b": MeshConfig(data=4)})


# ----- trainer fixtures ------------------------------------------------------------------------


def make_batch(seed, rows=B):
    """Random ids, two packed segments per row, exactly MASKED_PER_ROW trained tokens per row."""
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, VALID, (rows, T + 1)).astype(np.int32)
    mask = np.zeros((rows, T), np.int32)
    for r in range(rows):
        mask[r, rng.choice(T, MASKED_PER_ROW, replace=False)] = 1
    cut = 20
    segments = np.concatenate([np.ones((rows, cut)), 2 * np.ones((rows, T - cut))], 1)
    positions = np.concatenate([np.arange(cut), np.arange(T - cut)])
    return {
        "tokens": seq[:, :-1],
        "targets": seq[:, 1:],
        "loss_mask": mask,
        "segment_ids": segments.astype(np.int32),
        "positions": np.tile(positions, (rows, 1)).astype(np.int32),
    }


REF_BATCHES = read_only([make_batch(seed) for seed in range(REF_STEPS)])


def make_trainer(mesh=None, optim=OPT, **kw):
    return Trainer(
        MODEL, optim, total_steps=TOTAL, loss="sft", mesh=mesh, valid_vocab=VALID, seed=0, **kw
    )


def run(trainer, batches):
    """Step through `batches`; metrics pulled from the device once, at the end."""
    metrics = [trainer.step(b) for b in batches]
    return {k: np.asarray([float(m[k]) for m in jax.device_get(metrics)]) for k in metrics[0]}


@dataclasses.dataclass(frozen=True)
class Run:
    """A shared trainer after its reference run, and read-only host copies of what it left."""

    trainer: Trainer
    metrics: dict
    state: dict
    name: str = ""

    @classmethod
    def of(cls, trainer, batches=REF_BATCHES, name=""):
        metrics = run(trainer, batches)
        return cls(trainer, read_only(metrics), read_only(jax.device_get(trainer.state)), name)

    @property
    def params(self):
        return self.state["params"]

    def reset(self) -> "Run":
        """Put the trainer back to the state the reference run left (fresh device buffers:
        a step donates the ones it is given)."""
        place = lambda x, s: jax.device_put(np.array(x), s)  # noqa: E731
        self.trainer.state = jax.tree.map(place, self.state, self.trainer.state_shardings)
        return self


def reset_around(shared):
    """A function-scoped view of a module-scoped Run: reset before the test, and after it."""
    yield shared.reset()
    shared.reset()


@pytest.fixture(scope="module")
def shared_a():
    return Run.of(make_trainer())


@pytest.fixture(scope="module")
def shared_b():
    return Run.of(make_trainer())


SHARDED = {
    "data2_tensor4": MeshConfig(data=2, tensor=4),
    "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2),
}


@pytest.fixture(scope="module", params=sorted(SHARDED))
def shared_sharded(request):
    mesh = role_meshes({"policy": SHARDED[request.param]})["policy"]
    return Run.of(make_trainer(mesh), name=request.param)


@pytest.fixture(scope="module")
def shared_accum():
    return Run.of(make_trainer(optim=dataclasses.replace(OPT, grad_accum=2)))


@pytest.fixture
def run_a(shared_a):
    yield from reset_around(shared_a)


@pytest.fixture
def run_b(shared_b):
    yield from reset_around(shared_b)


@pytest.fixture
def sharded(shared_sharded):
    yield from reset_around(shared_sharded)


@pytest.fixture
def accum(shared_accum):
    yield from reset_around(shared_accum)


def _leaves_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----- trainer: numerics -----------------------------------------------------------------------


def test_same_seed_gives_identical_losses_and_params(run_a, run_b):
    ma, pa = run_a.metrics, run_a.params
    mb, pb = run_b.metrics, run_b.params
    np.testing.assert_array_equal(ma["loss"], mb["loss"])
    np.testing.assert_array_equal(ma["grad_norm"], mb["grad_norm"])
    _leaves_equal(pa, pb)
    assert len(set(ma["loss"].tolist())) == REF_STEPS  # the steps did change something
    assert np.all(ma["tokens"] == B * MASKED_PER_ROW)


def test_metrics_report_the_schedule_and_the_loss(run_a):
    m = run_a.metrics
    sched = lr_schedule(OPT, TOTAL)
    np.testing.assert_allclose(m["lr"], [float(sched(s)) for s in range(REF_STEPS)], rtol=1e-6)
    assert m["lr"][0] == 0.0 and m["lr"][2] == pytest.approx(OPT.lr)
    # Random ids over 261 valid ones: the first loss is near log(261), not log(512).
    assert abs(m["loss"][0] - math.log(VALID)) < 0.15
    assert np.all(m["grad_norm"] > 0) and np.all(np.isfinite(m["entropy"]))


def test_sharded_mesh_matches_one_device(run_a, sharded):
    m, ps = sharded.metrics, sharded.params
    ma, pa = run_a.metrics, run_a.params
    np.testing.assert_allclose(m["loss"], ma["loss"], rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], ma["grad_norm"], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(ps), jax.tree.leaves(pa), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def test_sharded_parameters_follow_the_rules(sharded):
    name, trainer = sharded.name, sharded.trainer
    specs = jax.tree.map(lambda x: x.sharding.spec, trainer.params)
    if name == "data2_tensor4":
        assert specs["layers"]["mlp"]["up"] == P(None, None, "tensor")
        assert specs["layers"]["mlp"]["down"] == P(None, "tensor", None)
        assert specs["embed"] == P("tensor", None)
        assert specs["layers"]["attn"]["q"] == P(None, None, "tensor", None)
        # 2 KV heads do not split 4 ways: replicated rather than failing.
        assert specs["layers"]["attn"]["k"] == P(None, None, None, None)
    else:
        assert specs["layers"]["mlp"]["up"] == P(None, "fsdp", "tensor")
        assert specs["layers"]["mlp"]["down"] == P(None, "tensor", "fsdp")
        assert specs["embed"] == P("tensor", "fsdp")
        assert specs["layers"]["attn"]["k"] == P(None, "fsdp", "tensor", None)
        assert specs["layers"]["attn"]["o"] == P(None, "tensor", None, "fsdp")
    assert specs["final_norm"]["weight"] == P(None)
    assert specs["layers"]["attn"]["q_norm"]["weight"] == P(None, None)
    assert trainer.params["layers"]["mlp"]["up"].sharding.mesh == trainer.mesh
    # Adam moments are placed like their parameters, the step replicated.
    for moment in ("mu", "nu"):
        tree = optax.tree_utils.tree_get(trainer.state["opt_state"], moment)
        assert jax.tree.map(lambda x: x.sharding.spec, tree) == specs
    assert trainer.state["step"].sharding.spec == P()


def test_rows_must_split_over_data_parallel_devices(sharded):
    trainer = sharded.trainer
    dp = data_parallel_size(trainer.mesh)
    step = trainer.step_count
    bad = make_batch(0, rows=dp + 1)
    with pytest.raises(
        ValueError, match=f"batch of {dp + 1} rows does not split over {dp} data-parallel devices"
    ):
        trainer.step(bad)
    with pytest.raises(ValueError, match="use a multiple of"):
        trainer.logprobs(bad)
    assert trainer.step_count == step


def test_grad_accum_matches_one_big_batch(run_a, accum):
    ma, pa = run_a.metrics, run_a.params
    trainer, m = accum.trainer, accum.metrics
    np.testing.assert_allclose(m["loss"], ma["loss"], rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], ma["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(m["entropy"], ma["entropy"], rtol=1e-5)
    assert np.all(m["tokens"] == B * MASKED_PER_ROW)
    for x, y in zip(jax.tree.leaves(accum.params), jax.tree.leaves(pa), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)
    # Micro-batches split the rows: 8 rows x grad_accum 2 on one device is fine, 3 is not.
    with pytest.raises(ValueError, match=r"grad_accum 2: use a multiple of 2"):
        trainer.step(make_batch(0, rows=3))


def test_grad_accum_matches_one_big_batch_with_padding_rows(run_a, accum):
    a, c = run_a.trainer, accum.trainer
    host = jax.device_get(a.state)
    c.state = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), host, c.state_shardings)
    batch = make_batch(4321)
    for k in ("loss_mask", "segment_ids"):  # rows 4-7 are padding, as build_rl_batch leaves them
        batch[k][B // 2 :] = 0
    ma, mc = jax.device_get(a.step(batch)), jax.device_get(c.step(batch))
    assert float(ma["tokens"]) == float(mc["tokens"]) == B // 2 * MASKED_PER_ROW
    np.testing.assert_allclose(float(mc["grad_norm"]), float(ma["grad_norm"]), rtol=1e-4)
    np.testing.assert_allclose(float(mc["loss"]), float(ma["loss"]), rtol=1e-5)


def test_loss_decreases_on_a_fixed_batch(run_a):
    trainer = run_a.trainer
    batch = make_batch(1234)
    losses = run(trainer, [batch] * 20)["loss"]
    assert losses[-1] < losses[0] - 0.5, losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


def test_logprobs_are_minus_cross_entropy_per_token(run_a):
    trainer = run_a.trainer
    batch = make_batch(77)
    lp = np.asarray(trainer.logprobs(batch))
    assert lp.shape == (B, T)
    # An independent forward: the plain model, no mesh, no vocabulary mask.
    forward = jax.jit(lambda p, b: trainer.model(p)(b["tokens"], b["positions"], b["segment_ids"]))
    logits = forward(jax.device_get(trainer.params), batch)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        np.asarray(logits)[..., :VALID], batch["targets"]
    )
    np.testing.assert_allclose(lp, -np.asarray(ce), rtol=1e-5, atol=1e-5)
    # Normalised over the valid ids only: differs from a softmax over all 512 rows.
    full = optax.softmax_cross_entropy_with_integer_labels(np.asarray(logits), batch["targets"])
    assert np.abs(lp + np.asarray(full)).max() > 1e-3
    np.testing.assert_array_equal(
        np.asarray(mask_vocab(logits, VALID))[..., VALID:], np.full((B, T, 512 - VALID), -1e9)
    )
    # The SFT loss of the next step is the masked mean of exactly these logprobs, up to the
    # float32 rounding of a mean of 128 terms (see f32_mean_tolerance).
    loss = float(trainer.step(batch)["loss"])
    terms = -lp.astype(np.float64)[batch["loss_mask"].astype(bool)]
    assert abs(loss - terms.mean()) <= f32_mean_tolerance(terms)


def test_export_serving_round_trips_exactly(run_a, tmp_path):
    trainer = run_a.trainer
    path = trainer.export_serving(tmp_path / "w")
    assert read_model_config(path) == MODEL
    loaded = load_params(path, trainer.model())
    _leaves_equal(loaded, jax.device_get(trainer.params))
    assert jax.tree.map(lambda x: x.sharding, loaded) == jax.tree.map(
        lambda x: x.sharding, trainer.params
    )
    _leaves_equal(trainer.load_serving(path), jax.device_get(trainer.params))
    # A bfloat16 export stores rounded weights and says so in its config.
    path16 = trainer.export_serving(tmp_path / "w16", dtype="bfloat16")
    assert read_model_config(path16).param_dtype == "bfloat16"
    rounded = jax.tree.map(
        lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)),
        jax.device_get(trainer.params),
    )
    _leaves_equal(load_params(path16, trainer.model()), rounded)
    assert export_path(tmp_path, 12) == tmp_path.absolute() / "weights" / "v000012"


def test_place_params_puts_host_weights_on_the_mesh(run_a, sharded):
    s = sharded.trainer
    host = run_a.params
    placed = s.place_params(host)
    _leaves_equal(placed, host)
    assert jax.tree.map(lambda x: x.sharding, placed) == s.param_shardings


# ----- checkpoints -----------------------------------------------------------------------------

GRAIN_STATE = {
    "next_index": 17,
    "worker_count": 0,
    "shards": [0, 3],
    "name": "textops/train",
    "nested": {"epoch": 2, "seed": None},
}


@pytest.mark.parametrize("async_save", [True, False])
def test_checkpoint_restores_bit_identical_state(run_a, tmp_path, async_save):
    trainer = run_a.trainer
    step = trainer.step_count
    host = jax.device_get(trainer.state)
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=async_save))
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    extra = {"data": GRAIN_STATE, "policy_version": 7}
    assert ckpt.save(step, trainer.state, extra=extra)
    # Training on (which donates the state buffers) must not disturb an in-flight save.
    trainer.step(make_batch(5))
    ckpt.wait()
    assert ckpt.latest_step() == step and ckpt.all_steps() == [step]
    state, got_extra = ckpt.restore(step, trainer.abstract_state())
    _leaves_equal(state, host)
    assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(
        lambda x: x.sharding, trainer.state
    )
    assert int(state["step"]) == step
    assert got_extra == extra and json.dumps(got_extra) == json.dumps(extra)
    ckpt.close()


def test_checkpoint_keeps_the_last_k_and_reports_missing_steps(run_a, tmp_path):
    trainer = run_a.trainer
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(keep=2, async_save=True)) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, trainer.state, extra={"step": step})
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4] and ckpt.latest_step() == 4
        on_disk = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
        assert on_disk == ["3", "4"]
        assert ckpt.restore(3, trainer.abstract_state())[1] == {"step": 3}
        with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 1 .*\[3, 4\]"):
            ckpt.restore(1, trainer.abstract_state())
    # A new Checkpointer over the same folder sees what was committed.
    again = Checkpointer(tmp_path / "ckpt", CheckpointConfig(keep=2))
    assert again.latest_step() == 4
    again.close()


def test_resume_from_a_checkpoint_continues_exactly(run_a, run_b, tmp_path):
    a, b = run_a.trainer, run_b.trainer
    resumed_batches = [make_batch(300 + i) for i in range(3)]
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=True)) as ckpt:
        step = a.step_count
        ckpt.save(step, a.state, extra={"data": GRAIN_STATE})
        want = run(a, resumed_batches)["loss"]
        # The other trainer has a different state (and step) until it restores.
        run(b, [make_batch(900), make_batch(901)])
        assert b.step_count != step
        state, extra = ckpt.restore(ckpt.latest_step(), b.abstract_state())
    b.state = state
    assert b.step_count == step and extra == {"data": GRAIN_STATE}
    got = run(b, resumed_batches)["loss"]
    np.testing.assert_array_equal(got, want)
    _leaves_equal(jax.device_get(b.state), jax.device_get(a.state))


def test_checkpoint_from_one_device_restores_onto_a_sharded_mesh(run_a, sharded, tmp_path):
    a, s = run_a.trainer, sharded.trainer
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(a.step_count, a.state)
        state, extra = ckpt.restore(a.step_count, s.abstract_state())
    assert extra == {}
    _leaves_equal(state, jax.device_get(a.state))
    assert (
        state["params"]["layers"]["mlp"]["up"].sharding == s.param_shardings["layers"]["mlp"]["up"]
    )
    s.state = state
    batch = make_batch(4242)
    la, ls = float(a.step(batch)["loss"]), float(s.step(batch)["loss"])
    np.testing.assert_allclose(ls, la, rtol=1e-5)


# ----- the policy loss in the trainer: reference model, grad accumulation ----------------------

POLICY_CFG = PolicyLossConfig(kl_coef=0.1, tis_cap=2.0)


@pytest.fixture(scope="module")
def policy_run():
    """A policy trainer with a frozen reference and grad_accum 2, and its first two steps on a
    batch whose IS ratios exp(prox - behavior) peak at 3 in rows 0-3 and at 1.5 in rows 4-7
    (so each micro-batch has its own maximum). Everything it returns is a read-only host copy:
    the tests read, never step, this trainer."""
    optim = dataclasses.replace(OPT, grad_accum=2, warmup_steps=0)
    trainer = Trainer(
        MODEL,
        optim,
        total_steps=TOTAL,
        loss="policy",
        loss_cfg=POLICY_CFG,
        valid_vocab=VALID,
        seed=0,
        reference=True,
    )
    initial = read_only(jax.device_get(trainer.params))
    batch = make_batch(55)
    lp = np.asarray(trainer.logprobs(batch), np.float64)
    rng = np.random.default_rng(55)
    delta = rng.uniform(0.0, math.log(1.5), (B, T))
    delta[2, np.flatnonzero(batch["loss_mask"][2])[3]] = math.log(3.0)
    delta[5, np.flatnonzero(batch["loss_mask"][5])[0]] = math.log(1.5)
    mask = batch["loss_mask"]
    batch["behavior_logprobs"] = ((lp - delta) * mask).astype(np.float32)
    batch["advantages"] = (np.where(np.arange(B) % 2, -1.0, 1.0)[:, None] * mask).astype(np.float32)
    m1 = jax.device_get(trainer.step(batch))
    m2 = jax.device_get(trainer.step(batch))
    out = {
        "initial": initial,
        "params": jax.device_get(trainer.params),
        "reference": jax.device_get(trainer.reference),
        "batch": batch,
        "logprobs": lp,
        "delta": delta,
        "m1": m1,
        "m2": m2,
    }
    return read_only(out)


def test_policy_trainer_first_step_matches_the_host_loss(policy_run):
    batch, delta, m1, m2 = (policy_run[k] for k in ("batch", "delta", "m1", "m2"))
    mask = batch["loss_mask"].astype(bool)
    adv = batch["advantages"].astype(np.float64)
    # prox = logp, so the ratio is 1 and the loss is -mean(min(e^log_is, 2) * A), where log_is
    # = logp - behavior is computed from what the device got: the float32 behavior logprobs,
    # not the float64 delta they were rounded from (half an ulp of a logprob ~ 2.4e-7 each).
    # The advantages are +-1 by row, so the mean cancels (~0.005 against terms ~1.2): compare
    # within the float32 error bound of the mean, which scales with sum(|terms|).
    log_is = policy_run["logprobs"] - batch["behavior_logprobs"].astype(np.float64)
    terms = (-np.minimum(np.exp(log_is), 2.0) * adv)[mask]
    assert abs(float(m1["loss"]) - terms.mean()) <= f32_mean_tolerance(terms)
    np.testing.assert_allclose(float(m1["mismatch_kl"]), -delta[mask].mean(), rtol=1e-4)
    np.testing.assert_allclose(float(m1["tis_capped_frac"]), (np.exp(delta) > 2)[mask].mean())
    assert float(m1["tokens"]) == mask.sum()
    # The reference is the initial policy: no KL at first, some after an update.
    assert abs(float(m1["kl_ref"])) < 1e-6
    assert float(m2["kl_ref"]) > 1e-7
    initial = policy_run["initial"]
    _leaves_equal(policy_run["reference"], initial)
    moved = [
        not np.array_equal(x, y)
        for x, y in zip(
            jax.tree.leaves(initial), jax.tree.leaves(policy_run["params"]), strict=True
        )
    ]
    assert all(moved)


def test_policy_trainer_reports_the_batch_max_is_ratio_under_grad_accum(policy_run):
    batch, delta, m1 = policy_run["batch"], policy_run["delta"], policy_run["m1"]
    mask = batch["loss_mask"].astype(bool)
    np.testing.assert_allclose(float(m1["is_ratio_max"]), np.exp(delta[mask]).max(), rtol=1e-4)
    np.testing.assert_allclose(float(m1["is_ratio_min"]), np.exp(delta[mask]).min(), rtol=1e-4)


def test_greedy_exact_is_greedy_decoding_in_one_forward(shared_a):
    """A row whose target is the model's own greedy continuation scores True; change one
    target token and it scores False (and padding rows never count)."""
    from rl.data.datasets import padded_batches

    trainer = shared_a.reset().trainer
    rng = np.random.default_rng(7)

    def greedy(context, n):
        ids = list(context)
        for _ in range(n):
            arr = np.asarray([ids], np.int32)
            batch = {
                "tokens": arr,
                "positions": np.arange(len(ids))[None].astype(np.int32),
                "segment_ids": np.ones_like(arr),
            }
            ids.append(int(jnp.argmax(trainer._logits(trainer.params, batch)[0, -1])))
        return ids

    rows = []
    for length in (5, 9):
        ids = greedy(rng.integers(0, VALID, length).tolist(), 4)
        mask = np.zeros(len(ids), np.int32)
        mask[length:] = 1
        rows.append({"tokens": np.asarray(ids, np.int32), "loss_mask": mask})
    wrong = dict(rows[1], tokens=rows[1]["tokens"].copy())
    wrong["tokens"][-2] = (wrong["tokens"][-2] + 1) % VALID
    rows.append(wrong)
    ((n, batch),) = padded_batches(rows, batch_size=4, pad_id=0)
    assert n == 3 and batch["tokens"].shape == (4, 12)
    assert np.asarray(trainer.greedy_exact(batch)).tolist()[:3] == [True, True, False]


def test_a_densely_packed_rl_batch_gives_each_token_the_logprob_it_has_alone(run_a):
    """`build_rl_batch(row_multiple=...)` puts several episodes in a row: each must see only
    itself (its segment ids and positions), so every trained token's log-probability is the
    one it gets in a row of its own, and a `token_mean` loss over the batch is unchanged."""
    from rl.data.trajectory import Trajectory, Turn
    from rl.train.rollouts import build_rl_batch

    rng = np.random.default_rng(7)
    eps = []
    for i in range(6):
        n_prompt, n_gen = 5 + i, 4 + (i % 3)
        ids = rng.integers(1, VALID, n_prompt + n_gen).tolist()
        eps.append(
            Trajectory(
                task_id=f"t{i % 2}", arm="real", env_backend="local", status="ok",
                reward=float(i % 2), group_id=f"g{i % 2}", turns=[Turn(agent_text="x", command="ls",
                token_span=(n_prompt, n_prompt + n_gen))], source="sampler", token_ids=ids,
                loss_mask=[0] * n_prompt + [1] * n_gen,
                behavior_logprobs=[None] * n_prompt + [-1.0] * n_gen,
                policy_version=[None] * n_prompt + [0] * n_gen, tokenizer="byte",
            )
        )  # fmt: skip
    cfg = PolicyLossConfig()
    sparse, _ = build_rl_batch(eps, rows=8, seq_len=T, cfg=cfg, version=0)
    dense, _ = build_rl_batch(eps, rows=8, seq_len=T, cfg=cfg, version=0, row_multiple=2)
    assert dense["tokens"].shape == (4, T)
    assert max(len(set(r.tolist()) - {0}) for r in dense["segment_ids"]) >= 2

    def by_target(batch):
        lp = np.asarray(run_a.trainer.logprobs(batch), np.float64)
        m = batch["loss_mask"].astype(bool)
        out = {}
        for r in range(len(m)):
            for s in set(batch["segment_ids"][r][m[r]].tolist()):
                at = m[r] & (batch["segment_ids"][r] == s)
                out[tuple(batch["targets"][r][at].tolist())] = lp[r][at]
        return out

    want, got = by_target(sparse), by_target(dense)
    assert sorted(got) == sorted(want) and len(got) == len(eps)
    # The same float32 forward over the same keys, the masked ones adding exact zeros; only the
    # order of the sums over the row (T terms, ~|log p| each) may differ: T ulps of |log p|.
    scale = max(np.abs(v).max() for v in want.values())
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=T * EPS32 * scale)
