"""Serving weights are read straight from their zarr v2 files and hashed as they are read
(`rl.model.zarr_read`): what that path returns is bit for bit what Orbax restores, for one
device, a sharded mesh, bfloat16 and chunk grids with ragged edges; any other layout falls
back to Orbax; and a damaged file is refused whichever file it is."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx

from rl.model import Qwen3, zarr_read
from rl.model.config import tiny
from rl.model.integrity import VERIFY_ENV, CheckpointError, check_layout, write_manifest
from rl.model.params_io import PARAMS_DIR, load_params, save_params
from rl.model.sharding import MeshConfig, make_mesh, shard_model
from rl.model.zarr_read import host_array, nested, read_arrays
from serving.vllm.worker_extension import read_orbax_params


def _model(seed: int = 0) -> Qwen3:
    return Qwen3(tiny(), rngs=nnx.Rngs(seed))


def _orbax(path: Path, model) -> dict:
    """Orbax's own restore of `path`'s params, placed like `model`'s: the reference."""
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )
    return ocp.StandardCheckpointer().restore(path / PARAMS_DIR, target)


def _same(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb, strict=True):
        assert x.dtype == y.dtype, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Qwen3]:
    model = _model()
    return save_params(model, tmp_path_factory.mktemp("weights") / "v1"), model


def test_save_params_writes_what_the_direct_reader_takes(saved):
    path, model = saved
    arrays = read_arrays(path / PARAMS_DIR, check_layout(path))
    assert arrays is not None
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    assert sorted(arrays) == sorted(".".join(k.key for k in p) for p, _ in leaves)
    for a in arrays.values():  # aligned, so a CPU device aliases instead of copying
        assert a.ctypes.data % 64 == 0 and a.flags.c_contiguous


def test_load_params_equals_orbax_restore_bit_for_bit(saved):
    path, model = saved
    _same(load_params(path, _model(seed=1)), _orbax(path, model))


def test_a_sharded_save_reads_back_onto_a_sharded_model(tmp_path):
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = shard_model(_model(seed=3), mesh)
    path = save_params(model, tmp_path / "sharded")
    chunked = json.loads((path / PARAMS_DIR / "layers.mlp.up" / ".zarray").read_text())
    assert chunked["chunks"] != chunked["shape"]  # one chunk per shard: a real grid
    into = shard_model(_model(seed=4), mesh)
    got = load_params(path, into)
    _same(got, _orbax(path, model))
    served = nnx.to_pure_dict(nnx.state(into, nnx.Param))
    for x, want in zip(jax.tree.leaves(got), jax.tree.leaves(served), strict=True):
        assert x.sharding == want.sharding


def test_bfloat16_weights_and_a_cast_on_load(tmp_path):
    model = _model(seed=5)
    path = save_params(model, tmp_path / "bf16", dtype="bfloat16")
    arrays = read_arrays(path / PARAMS_DIR, check_layout(path))
    assert {a.dtype for a in arrays.values()} == {np.dtype(jnp.bfloat16)}
    got = load_params(path, _model())  # stored bf16, served f32: cast, as Orbax casts
    _same(got, _orbax(path, _model()))
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype("float32")}


def _write_zarr2(array_dir: Path, value: np.ndarray, chunks: tuple[int, ...]) -> None:
    """A zarr v2 array written by tensorstore (not by the reader's author): the reference."""
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(array_dir)},
        "metadata": {
            "shape": list(value.shape),
            "chunks": list(chunks),
            "dtype": value.dtype.str,
            "compressor": None,
        },
    }
    ts.open(spec, create=True).result().write(value).result()


@pytest.mark.parametrize("shape,chunks", [((5, 3), (2, 2)), ((7,), (3,)), ((4, 6, 2), (4, 6, 2))])
def test_ragged_chunk_grids_read_as_tensorstore_wrote_them(tmp_path, shape, chunks):
    value = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    _write_zarr2(tmp_path / "x", value, chunks)
    arrays = read_arrays(tmp_path, None)
    np.testing.assert_array_equal(arrays["x"], value)


def _damage_chunk(path: Path) -> None:
    (path / PARAMS_DIR / "embed" / "0.0").unlink()


def _compressed(path: Path) -> None:
    _rewrite(path, ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=False))


def _ocdbt(path: Path) -> None:
    _rewrite(path, ocp.PyTreeCheckpointHandler())


def _zarr3(path: Path) -> None:
    _rewrite(path, ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True))


def _rewrite(path: Path, handler) -> None:
    """Re-save `path`'s params with another Orbax handler (and a fresh manifest)."""
    params = ocp.StandardCheckpointer().restore(path / PARAMS_DIR)
    shutil.rmtree(path / PARAMS_DIR)
    (path / "manifest.json").unlink()
    ocp.Checkpointer(handler).save(path / PARAMS_DIR, args=ocp.args.PyTreeSave(params))
    write_manifest(path)


@pytest.mark.parametrize("layout", [_compressed, _ocdbt, _zarr3], ids=lambda f: f.__name__[1:])
def test_other_layouts_fall_back_to_orbax_with_the_same_result(saved, tmp_path, layout):
    path, model = saved
    other = tmp_path / "other"
    shutil.copytree(path, other)
    layout(other)
    assert read_arrays(other / PARAMS_DIR, check_layout(other)) is None
    _same(load_params(other, _model(seed=2)), _orbax(path, model))
    cfg, host = read_orbax_params(other)
    _same(host, read_orbax_params(path)[1])


def test_a_missing_chunk_is_not_read_directly(saved, tmp_path):
    other = tmp_path / "holed"
    shutil.copytree(saved[0], other)
    _damage_chunk(other)
    assert read_arrays(other / PARAMS_DIR, None) is None


def test_nested_rebuilds_orbax_tree(saved):
    path, _ = saved
    arrays = read_arrays(path / PARAMS_DIR, None)
    tree = nested(path / PARAMS_DIR, arrays)
    reference = ocp.PyTreeCheckpointer().restore(
        path / PARAMS_DIR,
        args=ocp.args.PyTreeRestore(
            restore_args=jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        ),
    )
    _same(tree, reference)
    assert nested(path / PARAMS_DIR, {k: v for k, v in arrays.items() if k != "embed"}) is None


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 1
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("target", ["embed/0.0", "embed/.zarray", "_METADATA"])
def test_a_flipped_bit_in_any_file_is_refused(saved, tmp_path, target):
    bad = tmp_path / "bad"
    shutil.copytree(saved[0], bad)
    _flip(bad / PARAMS_DIR / target)
    with pytest.raises(CheckpointError, match=f"params/{target} does not match its sha256"):
        load_params(bad, _model(), require_manifest=True)
    with pytest.raises(CheckpointError, match=f"params/{target} does not match its sha256"):
        read_orbax_params(bad)


def test_params_that_do_not_fit_their_config_are_named(saved, tmp_path):
    """A checkpoint whose model_config.json says one thing and whose arrays another."""
    bad = tmp_path / "misfit"
    shutil.copytree(saved[0], bad)
    cfg = json.loads((bad / "model_config.json").read_text())
    (bad / "model_config.json").write_text(json.dumps({**cfg, "vocab_size": 520}))
    (bad / "manifest.json").unlink()
    write_manifest(bad)
    with pytest.raises(ValueError, match=r"embed has shape \(512, 64\) \(served: \(520, 64\)\)"):
        load_params(bad, Qwen3(tiny(vocab_size=520), rngs=nnx.Rngs(0)))


def test_buffers_are_reused_only_once_nothing_refers_to_them(saved, tmp_path):
    path, model = saved
    other = save_params(_model(seed=7), tmp_path / "other")
    first = read_arrays(path / PARAMS_DIR, None)
    want = first["embed"].copy()
    held = jax.device_put(first["embed"])  # a CPU device aliases the aligned buffer
    del first
    for _ in range(3):  # other weights, read while `held` lives: never into its buffer
        read_arrays(other / PARAMS_DIR, None)
    np.testing.assert_array_equal(np.asarray(held), want)
    del held
    pool = zarr_read._BUFFERS
    read_arrays(path / PARAMS_DIR, None)
    allocated = len(pool._raw)
    for _ in range(3):  # nothing refers to earlier reads: their buffers serve these
        read_arrays(other / PARAMS_DIR, None)
    assert len(pool._raw) == allocated
    fresh = host_array((3, 5), np.float32)
    assert fresh.ctypes.data % 64 == 0 and fresh.shape == (3, 5)


def _reseal(path: Path) -> None:
    """A fresh manifest, written once the filesystem's clock has moved past every file's
    ctime (a probe's ctime, not a sleep), so that each file's identity is recorded."""
    newest = max(p.stat().st_ctime_ns for p in path.rglob("*") if p.is_file())
    probe = path.parent / f".{path.name}.probe"
    while True:
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns > newest:
            break
    probe.unlink()
    (path / "manifest.json").unlink()
    write_manifest(path)


def _hashed_reads(monkeypatch) -> list[tuple[str, bool]]:
    """(file name, whether hashed) of every chunk file `read_arrays` reads from now on."""
    reads, real = [], zarr_read._read_hashed

    def spy(file, into, *, hashed=True):
        reads.append((f"{file.parent.name}/{file.name}", hashed))
        return real(file, into, hashed=hashed)

    monkeypatch.setattr(zarr_read, "_read_hashed", spy)
    return reads


def test_files_unchanged_since_sealed_on_this_machine_are_not_hashed_again(
    saved, tmp_path, monkeypatch
):
    path = tmp_path / "sealed"
    shutil.copytree(saved[0], path)
    _reseal(path)
    model = saved[1]
    layout = check_layout(path)
    assert "params/embed/0.0" in layout["unchanged"]  # sealed here, untouched since
    reads = _hashed_reads(monkeypatch)
    _same(load_params(path, _model(seed=1)), _orbax(path, model))
    assert reads and not any(hashed for _, hashed in reads)
    reads.clear()
    monkeypatch.setenv(VERIFY_ENV, "always")
    assert check_layout(path)["unchanged"] == set()
    load_params(path, _model(seed=1))
    assert reads and all(hashed for _, hashed in reads)
    monkeypatch.delenv(VERIFY_ENV)
    copy = tmp_path / "copy"  # other inodes: every file hashed, and the copy verifies
    shutil.copytree(path, copy)
    assert json.loads((copy / "manifest.json").read_text())["files"]["params/embed/0.0"]["identity"]
    assert check_layout(copy)["unchanged"] == set()
    _same(load_params(copy, _model(seed=1)), _orbax(path, model))


def test_a_change_that_restores_size_and_mtime_is_still_caught(saved, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved[0], bad)
    _reseal(bad)  # sealed on this machine: identities recorded
    assert "params/embed/0.0" in check_layout(bad)["unchanged"]
    chunk = bad / PARAMS_DIR / "embed" / "0.0"
    st = chunk.stat()
    _flip(chunk)
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back; ctime moved on
    assert chunk.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(CheckpointError, match="params/embed/0.0 does not match its sha256"):
        load_params(bad, _model(), require_manifest=True)
    replaced = bad / PARAMS_DIR / "embed" / "replacement"  # another inode, same bytes
    shutil.copyfile(chunk, replaced)
    os.replace(replaced, chunk)
    with pytest.raises(CheckpointError, match="params/embed/0.0 does not match its sha256"):
        read_orbax_params(bad)


def test_a_file_changed_while_read_unhashed_is_refused(saved, tmp_path, monkeypatch):
    racy = tmp_path / "racy"
    shutil.copytree(saved[0], racy)
    _reseal(racy)
    assert "params/embed/0.0" in check_layout(racy)["unchanged"]
    real = zarr_read._read_hashed

    def read_then_alter(file, into, *, hashed=True):
        digest = real(file, into, hashed=hashed)
        if file.parent.name == "embed":
            _flip(file)  # after its bytes were read, before the read is done
        return digest

    monkeypatch.setattr(zarr_read, "_read_hashed", read_then_alter)
    with pytest.raises(CheckpointError, match="params/embed/0.0 changed while read"):
        load_params(racy, _model(), require_manifest=True)
