"""serving/vllm without vLLM: the launcher against a small real HTTP server standing in for
`vllm serve`, the worker extension against a tiny Orbax checkpoint and fake model runners
(vLLM's `load_weights`, tpu-inference's parameter pytree), and the publisher against an
aiohttp fake of vLLM's dev-mode routes that records every request.
"""

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from flax import nnx
from safetensors.numpy import load_file

from rl.model import Qwen3, save_hf, tiny
from rl.model.integrity import MANIFEST, CheckpointError
from rl.model.params_io import save_params
from serving.vllm.config import VllmConfig
from serving.vllm.launcher import (
    REPO_ROOT,
    WORKER_EXTENSION,
    ServedModel,
    VllmLaunchError,
    build_vllm_command,
    build_vllm_env,
    clear_stale_libtpu_lock,
    launch_servers,
    lockfile_holders,
    lockfile_is_locked,
    stop_servers,
)
from serving.vllm.publisher import VllmPublisher, VllmPublishError
from serving.vllm.worker_extension import OrbaxWeightLoader
from tests.fakes import PlannedProcess as Proc
from tests.fakes import free_port

# ----- launcher ----------------------------------------------------------------------------------


def test_build_vllm_command_is_the_documented_argv():
    cfg = VllmConfig(
        max_model_len=4096, gpu_memory_utilization=0.8, extra_args=["--dtype", "bfloat16"]
    )
    proc = Proc("agent_serve", (4, 5, 6, 7), 8001)
    assert build_vllm_command("/m/qwen", proc, cfg, served_model_name="agent") == [
        "vllm", "serve", "/m/qwen", "--tensor-parallel-size", "4", "--max-model-len", "4096",
        "--port", "8001", "--host", "127.0.0.1", "--served-model-name", "agent",
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--gpu-memory-utilization", "0.8",
        "--worker-extension-cls", "serving.vllm.worker_extension.OrbaxWeightLoader",
        "--dtype", "bfloat16",
    ]  # fmt: skip
    off = build_vllm_command(
        "/m", proc, VllmConfig(enable_prefix_caching=False), served_model_name="a", host="0.0.0.0"
    )
    assert "--no-enable-prefix-caching" in off and "--enable-prefix-caching" not in off
    assert off[off.index("--host") + 1] == "0.0.0.0" and "--speculative-config" not in off
    spec = build_vllm_command(
        "/m", proc, VllmConfig(speculate=6, speculate_ngram=4), served_model_name="a"
    )
    assert json.loads(spec[spec.index("--speculative-config") + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    }
    for bad in ({"speculate": -1}, {"speculate": 33}, {"speculate_ngram": 0}):
        with pytest.raises(ValueError, match=f"VllmConfig.{next(iter(bad))}="):
            VllmConfig(**bad)
    with pytest.raises(ValueError, match="no http_port"):
        build_vllm_command("/m", Proc("policy_train", (0,), None), cfg, served_model_name="a")


def test_build_vllm_env_puts_the_plan_on_top_and_enables_dev_mode():
    proc = Proc("sim_serve", (2, 3), 8002, {"TPU_VISIBLE_CHIPS": "2,3", "HOME": "/plan"})
    env = build_vllm_env(proc, {"HOME": "/base", "PATH": "/bin", "PYTHONPATH": "/x"})
    assert env["TPU_VISIBLE_CHIPS"] == "2,3" and env["HOME"] == "/plan"
    assert env["PATH"] == "/bin" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(REPO_ROOT), "/x"]
    assert WORKER_EXTENSION.startswith("serving.") and (REPO_ROOT / "serving").is_dir()


def test_stale_lockfile_is_removed_but_a_held_one_is_kept(tmp_path):
    stale = tmp_path / "stale_lockfile"
    stale.write_text("")
    assert clear_stale_libtpu_lock(stale) and not stale.exists()
    assert not clear_stale_libtpu_lock(stale)  # absent: nothing to do

    held = tmp_path / "held_lockfile"
    held.write_text("")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1]); print('open', flush=True); time.sleep(60)",
            str(held),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        assert lockfile_holders(held) == [holder.pid]
        assert not clear_stale_libtpu_lock(held) and held.exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_a_posix_lock_on_the_lockfile_counts_as_held(tmp_path):
    lockfile = tmp_path / "lockfile"
    lockfile.write_text("")
    assert not lockfile_is_locked(lockfile)
    locker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'w');"
            " fcntl.lockf(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
            str(lockfile),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert locker.stdout.readline().strip() == "locked"
        assert lockfile_is_locked(lockfile)
    finally:
        locker.kill()
        locker.wait(timeout=10)
    assert not lockfile_is_locked(lockfile) and clear_stale_libtpu_lock(lockfile)


FAKE_VLLM = r"""
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, mode, delay_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
print(f"fake vllm on port {port}, mode {mode}", flush=True)
if mode == "crash":
    for i in range(60):
        print(f"crash-line-{i:03d}", flush=True)
    sys.exit(1)
ready_at = time.monotonic() + delay_s

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and mode == "ok" and time.monotonic() >= ready_at
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


class FakeClock:
    """Time that advances by what `sleep` is asked for (plus a real nap, so the fake servers
    get real time to start)."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, dt: float) -> None:
        self.now += dt
        time.sleep(0.02)


@pytest.fixture
def fake_vllm(tmp_path):
    """A spawner that runs FAKE_VLLM in place of `vllm serve`, on the port from the argv;
    `modes[role] = (mode, health_delay_s)`. Records (argv, env, clock at spawn, process)."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    spawned = []

    def make(modes, clock=time.monotonic):
        def spawn(argv, env, log_file):
            role = argv[argv.index("--served-model-name") + 1]
            mode, delay = modes[role]
            port = argv[argv.index("--port") + 1]
            proc = subprocess.Popen(
                [sys.executable, str(script), port, mode, str(delay)],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            spawned.append(SimpleNamespace(argv=argv, env=env, at=clock(), proc=proc))
            return proc

        return spawn

    yield make, spawned
    for s in spawned:  # only what this test started, by its handle
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=10)


def _serve_plan(*roles):
    return [
        Proc(role, (i,), free_port(), {"TPU_VISIBLE_CHIPS": str(i)}) for i, role in enumerate(roles)
    ]


def _models(*roles):
    return {role: ServedModel(f"/models/{role}", role) for role in roles}


def test_launch_clears_the_lock_staggers_and_waits_for_health(tmp_path, fake_vllm):
    make, spawned = fake_vllm
    lockfile = tmp_path / "libtpu_lockfile"
    lockfile.write_text("")
    clock = FakeClock()
    plan = _serve_plan("agent_serve", "sim_serve")
    cfg = VllmConfig(start_stagger_s=20.0, health_timeout_s=600.0)
    lock_seen = []
    spawn = make({"agent_serve": ("ok", 0.3), "sim_serve": ("ok", 0.3)}, clock)

    def spawn_checking_lock(argv, env, log_file):
        lock_seen.append(lockfile.exists())
        return spawn(argv, env, log_file)

    servers = launch_servers(
        plan,
        cfg,
        _models("agent_serve", "sim_serve"),
        log_dir=tmp_path / "logs",
        lockfile=lockfile,
        spawn=spawn_checking_lock,
        clock=clock,
        sleep=clock.sleep,
        poll_s=1.0,
    )
    try:
        assert lock_seen == [False, False]
        assert spawned[1].at - spawned[0].at >= 20.0
        for server, proc, s in zip(servers, plan, spawned, strict=True):
            assert server.url == f"http://127.0.0.1:{proc.http_port}"
            with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
                assert resp.status == 200
            assert s.argv[:3] == ["vllm", "serve", f"/models/{proc.role}"]
            assert s.env["TPU_VISIBLE_CHIPS"] == proc.env["TPU_VISIBLE_CHIPS"]
            assert s.env["VLLM_SERVER_DEV_MODE"] == "1"
            assert "fake vllm on port" in server.log_path.read_text()
    finally:
        stop_servers(servers, timeout_s=10)
    assert all(s.proc.poll() is not None for s in spawned)


def test_a_server_that_exits_fails_the_launch_with_its_log_tail(tmp_path, fake_vllm):
    make, spawned = fake_vllm
    plan = _serve_plan("agent_serve", "sim_serve")
    cfg = VllmConfig(start_stagger_s=0.0, health_timeout_s=60.0)
    with pytest.raises(VllmLaunchError) as err:
        launch_servers(
            plan,
            cfg,
            _models("agent_serve", "sim_serve"),
            log_dir=tmp_path,
            lockfile=tmp_path / "lock",
            spawn=make({"agent_serve": ("ok", 0.0), "sim_serve": ("crash", 0.0)}),
            poll_s=0.1,
        )
    message = str(err.value)
    assert "sim_serve" in message and "exited with code 1" in message
    assert "crash-line-059" in message and "crash-line-020" in message  # the last 40 lines
    assert "crash-line-019" not in message
    assert all(s.proc.poll() is not None for s in spawned)  # the healthy one was stopped too


def test_a_server_that_never_gets_healthy_times_out(tmp_path, fake_vllm):
    make, spawned = fake_vllm
    clock = FakeClock()
    cfg = VllmConfig(start_stagger_s=0.0, health_timeout_s=30.0)
    with pytest.raises(VllmLaunchError, match=r"within 30s") as err:
        launch_servers(
            _serve_plan("agent_serve"),
            cfg,
            _models("agent_serve"),
            log_dir=tmp_path,
            lockfile=tmp_path / "lock",
            spawn=make({"agent_serve": ("unhealthy", 0.0)}, clock),
            clock=clock,
            sleep=clock.sleep,
            poll_s=1.0,
        )
    assert "fake vllm on port" in str(err.value)  # the log tail
    assert spawned[0].proc.poll() is not None


# ----- worker extension --------------------------------------------------------------------------


class RecordingModel:
    """Stands in for a vLLM model: `load_weights` consumes and records the pairs."""

    def __init__(self):
        self.loaded = []

    def load_weights(self, weights):
        self.loaded = [(name, t) for name, t in weights]
        return {name for name, _ in self.loaded}


class FakeWorker(OrbaxWeightLoader):
    def __init__(self, runner):
        self.model_runner = runner


def _model(cfg, seed=0):
    return Qwen3(cfg.replace(initializer_range=0.3), rngs=nnx.Rngs(seed))


@pytest.mark.parametrize(
    "cfg",
    [
        tiny(),
        tiny(
            architecture="Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, tie_word_embeddings=False
        ),
    ],
    ids=["qwen3-tied", "qwen2-untied-bias"],
)
def test_load_weights_receives_exactly_what_save_hf_writes(tmp_path, cfg):
    model = _model(cfg)
    ckpt = save_params(model, tmp_path / "v3", dtype="bfloat16")
    want = load_file(save_hf(cfg, model, tmp_path / "hf", dtype="bfloat16") / "model.safetensors")
    runner = SimpleNamespace(model=RecordingModel())
    worker = FakeWorker(runner)
    out = worker.load_orbax_weights(str(ckpt), "3")  # JSON args may arrive as strings
    assert out["version"] == 3 and out["tensors"] == len(want) and out["backend"] == "load_weights"
    loaded = dict(runner.model.loaded)
    assert sorted(loaded) == sorted(want) and len(loaded) == len(runner.model.loaded)
    for name, tensor in loaded.items():
        assert str(tensor.dtype) == "torch.bfloat16", name
        got = tensor.float().numpy()
        assert got.shape == want[name].shape, name
        np.testing.assert_array_equal(got, want[name].astype(np.float32), err_msg=name)
    assert worker.simloop_weight_version() == {"version": 3, "path": str(ckpt)}


def test_an_older_version_is_refused_and_the_served_one_kept(tmp_path):
    ckpt = save_params(_model(tiny()), tmp_path / "w")
    worker = FakeWorker(SimpleNamespace(model=RecordingModel()))
    worker.load_orbax_weights(str(ckpt), 5)
    worker.model_runner.model.loaded = []
    with pytest.raises(ValueError, match="older than the served version 5"):
        worker.load_orbax_weights(str(ckpt), 4)
    assert (
        worker.model_runner.model.loaded == [] and worker.simloop_weight_version()["version"] == 5
    )
    with pytest.raises(FileNotFoundError, match="model_config.json"):
        worker.load_orbax_weights(str(tmp_path / "missing"), 6)


def _largest(root):
    return max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["unsealed", "flipped", "nan"])
def test_a_checkpoint_simloop_serve_would_refuse_is_refused_untouched(tmp_path, damage):
    """The worker reads what `simloop serve` reads: a sealed checkpoint that verifies and holds
    finite numbers. Anything else is refused before the model is touched."""
    model = _model(tiny())
    worker = FakeWorker(SimpleNamespace(model=RecordingModel()))
    worker.load_orbax_weights(str(save_params(model, tmp_path / "good")), 1)
    worker.model_runner.model.loaded = []
    if damage == "nan":
        model.embed.value = model.embed.value.at[3, 2].set(jnp.nan)
    bad = save_params(model, tmp_path / "bad")
    if damage == "unsealed":
        (bad / MANIFEST).unlink()
        expect = "has no manifest.json"
    elif damage == "flipped":
        target = _largest(bad / "params")
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        expect = "sha256"
    else:
        expect = "non-finite"
    with pytest.raises(CheckpointError, match=expect):
        worker.load_orbax_weights(str(bad), 2)
    assert worker.model_runner.model.loaded == []
    assert worker.simloop_weight_version() == {"version": 1, "path": str(tmp_path / "good")}


SENTINEL = 7.0


def tpu_inference_state(cfg, head_pad=0, kv_repeat=1):
    """An `nnx.State` laid out like tpu-inference's flax_nnx Qwen3 (tpu_inference/models/jax/
    qwen3.py): HF module names, einsum kernels [D, heads, H] / [N, H, D] / [D, F], leaves named
    weight / kernel / embedding / scale, padded head dim and repeated KV heads."""
    D, F, V, N, K = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.vocab_size,
        cfg.num_heads,
        cfg.num_kv_heads * kv_repeat,
    )
    H = cfg.head_dim + head_pad

    def param(*shape):
        return nnx.Param(jnp.full(shape, SENTINEL, jnp.bfloat16))

    def layer():
        return {
            "input_layernorm": {"weight": param(D)},
            "post_attention_layernorm": {"weight": param(D)},
            "self_attn": {
                "q_proj": {"weight": param(D, N, H)},
                "k_proj": {"weight": param(D, K, H)},
                "v_proj": {"weight": param(D, K, H)},
                "o_proj": {"weight": param(N, H, D)},
                "q_norm": {"scale": param(H)},
                "k_norm": {"scale": param(H)},
            },
            "mlp": {
                "gate_proj": {"kernel": param(D, F)},
                "up_proj": {"kernel": param(D, F)},
                "down_proj": {"kernel": param(F, D)},
            },
        }

    tree = {
        "model": {
            "embed_tokens": {"embedding": param(V, D)},
            "norm": {"weight": param(D)},
            "layers": {i: layer() for i in range(cfg.num_layers)},
        },
        "rng": nnx.RngKey(jax.random.key(0)),
    }
    if not cfg.tie_word_embeddings:
        tree["lm_head"] = {"kernel": param(D, V)}
    return nnx.State(tree)


@pytest.mark.parametrize("head_pad,kv_repeat", [(0, 1), (16, 2)], ids=["exact", "padded"])
def test_tpu_inference_state_gets_simloop_params_in_its_layout(tmp_path, head_pad, kv_repeat):
    cfg = tiny(tie_word_embeddings=False)
    model = _model(cfg, seed=1)
    ckpt = save_params(model, tmp_path / "w")
    state = tpu_inference_state(cfg, head_pad, kv_repeat)
    runner = SimpleNamespace(state=state, state_leaves=("stale",))
    out = FakeWorker(runner).load_orbax_weights(str(ckpt), 1)
    assert out["backend"] == "tpu-inference-state"

    ours = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def want(x):  # simloop's layout is tpu-inference's, before its padding
        return np.asarray(x).astype(jnp.bfloat16)

    def pad(x, axis):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, head_pad)
        return np.pad(x, widths)

    m = state["model"]
    np.testing.assert_array_equal(m["embed_tokens"]["embedding"].get_value(), want(ours["embed"]))
    np.testing.assert_array_equal(state["lm_head"]["kernel"].get_value(), want(ours["lm_head"]))
    np.testing.assert_array_equal(
        m["norm"]["weight"].get_value(), want(ours["final_norm"]["weight"])
    )
    layers = ours["layers"]
    for i in range(cfg.num_layers):
        attn, got = layers["attn"], m["layers"][i]["self_attn"]
        expect = {
            "q_proj": pad(want(attn["q"][i]), 2),
            "k_proj": np.repeat(pad(want(attn["k"][i]), 2), kv_repeat, axis=1),
            "v_proj": np.repeat(pad(want(attn["v"][i]), 2), kv_repeat, axis=1),
            "o_proj": pad(want(attn["o"][i]), 1),
        }
        for name, value in expect.items():
            np.testing.assert_array_equal(got[name]["weight"].get_value(), value, err_msg=name)
        np.testing.assert_array_equal(
            got["q_norm"]["scale"].get_value(), pad(want(attn["q_norm"]["weight"][i]), 0)
        )
        mlp = m["layers"][i]["mlp"]
        for ours_name, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            np.testing.assert_array_equal(
                mlp[theirs]["kernel"].get_value(), want(layers["mlp"][ours_name][i])
            )
        np.testing.assert_array_equal(
            m["layers"][i]["input_layernorm"]["weight"].get_value(),
            want(layers["attn_norm"]["weight"][i]),
        )
    leaves = jax.tree_util.tree_leaves(state)
    assert len(runner.state_leaves) == len(leaves)
    assert all(a is b for a, b in zip(runner.state_leaves, leaves, strict=True))


def test_a_mismatched_runner_state_is_refused_untouched(tmp_path):
    cfg = tiny()
    ckpt = save_params(_model(cfg), tmp_path / "w")
    smaller = tpu_inference_state(cfg.replace(num_layers=1))  # one layer fewer than the ckpt
    with pytest.raises(ValueError, match="disagree"):
        FakeWorker(SimpleNamespace(state=smaller)).load_orbax_weights(str(ckpt), 1)
    wider = tpu_inference_state(cfg.replace(intermediate_size=256))
    with pytest.raises(
        ValueError, match=r"mlp\.down_proj\.weight: the checkpoint's shape \(128, 64\)"
    ):
        FakeWorker(SimpleNamespace(state=wider)).load_orbax_weights(str(ckpt), 1)
    for state in (smaller, wider):
        for _, var in nnx.to_flat_state(state):
            if isinstance(var, nnx.Param):
                assert bool(jnp.all(var.get_value() == SENTINEL))
    with pytest.raises(NotImplementedError, match="torchax"):
        FakeWorker(SimpleNamespace(state={"w": 1})).load_orbax_weights(str(ckpt), 1)


# ----- publisher ---------------------------------------------------------------------------------


class FakeVllm:
    """vLLM's dev-mode routes and a completion endpoint; records (route, JSON body or None).
    `workers` results per collective_rpc; `fail` = (route, status, body) or (route, "hang")."""

    def __init__(self, workers=1, fail=None, report_version=None):
        self.workers, self.fail, self.report_version = workers, fail, report_version
        self.requests = []

    async def handle(self, request):
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.path, body))
        if self.fail and self.fail[0] == request.path:
            if self.fail[1] == "hang":
                await asyncio.sleep(30)
            return web.json_response(self.fail[2], status=self.fail[1])
        if request.path == "/collective_rpc":
            path, version = body["args"]
            v = self.report_version if self.report_version is not None else version
            return web.json_response(
                {"results": [{"version": v, "path": path, "tensors": 3}] * self.workers}
            )
        if request.path == "/reset_prefix_cache":
            return web.Response(status=200)
        return web.json_response(
            {"choices": [{"index": 0, "text": "x", "token_ids": [42], "finish_reason": "length"}]}
        )


@pytest_asyncio.fixture
async def fake_servers():
    runners = []

    async def start(*peers):
        urls = []
        for peer in peers:
            app = web.Application()
            for route in ("/collective_rpc", "/reset_prefix_cache", "/v1/completions"):
                app.router.add_post(route, peer.handle)
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        return urls

    yield start
    for r in runners:
        await r.cleanup()


async def test_publish_sends_the_exact_requests_and_reports(fake_servers):
    peers = [FakeVllm(workers=1), FakeVllm(workers=2)]
    urls = await fake_servers(*peers)
    async with VllmPublisher(urls, model_name="agent", timeout_s=10) as publisher:
        report = await publisher.publish("/ckpt/weights/v000007", 7)
    assert (report.version, report.path, report.servers) == (7, "/ckpt/weights/v000007", urls)
    assert 0 <= report.load_s <= report.first_token_s
    for peer in peers:
        assert peer.requests == [
            ("/collective_rpc", {"method": "load_orbax_weights",
                                 "args": ["/ckpt/weights/v000007", 7]}),
            ("/reset_prefix_cache", None),
            ("/v1/completions", {"prompt": [0], "n": 1, "max_tokens": 1, "temperature": 0.0,
                                 "top_p": 1.0, "return_token_ids": True, "model": "agent"}),
        ]  # fmt: skip


VLLM_ERROR = {
    "error": {
        "message": "ValueError: tensor gate_proj does not match",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


@pytest.mark.parametrize(
    "peer,expect",
    [
        (FakeVllm(fail=("/collective_rpc", 500, VLLM_ERROR)),
         ["load_orbax_weights('/w', 3) failed", "-> 500", "tensor gate_proj does not match",
          "response body", "InternalServerError"]),
        (FakeVllm(fail=("/collective_rpc", 404, {"detail": "Not Found"})),
         ["-> 404", "Not Found", "VLLM_SERVER_DEV_MODE=1"]),
        (FakeVllm(workers=2, report_version=2),
         ["2 of 2 workers did not report version 3", '"version": 2']),
        (FakeVllm(fail=("/collective_rpc", 200, {"results": []})), ["--worker-extension-cls"]),
        (FakeVllm(fail=("/collective_rpc", "hang")), ["no answer within 0.5s"]),
        (FakeVllm(fail=("/v1/completions", 404, {"error": {"message": "model agent missing"}})),
         ["probe completion failed", "model agent missing"]),
    ],
    ids=["500", "404-dev-mode", "stale-worker", "no-results", "timeout", "probe"],
)  # fmt: skip
async def test_publish_failures_name_the_server_and_its_answer(fake_servers, peer, expect):
    (url,) = await fake_servers(peer)
    # Only the hanging peer is meant to time out: the others answer, however loaded the machine.
    timeout_s = 0.5 if peer.fail and peer.fail[1] == "hang" else 30.0
    async with VllmPublisher([url], model_name="agent", timeout_s=timeout_s) as publisher:
        with pytest.raises(VllmPublishError) as err:
            await publisher.publish("/w", 3)
    message = str(err.value)
    assert message.startswith(url), message
    for text in expect:
        assert text in message, message


async def test_every_failing_server_is_named_and_a_dead_one_is_reported(fake_servers):
    (alive,) = await fake_servers(FakeVllm(fail=("/collective_rpc", 503, {"error": "busy"})))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with VllmPublisher([alive, dead], model_name="agent", timeout_s=5) as publisher:
        with pytest.raises(VllmPublishError, match="2 of 2 servers failed") as err:
            await publisher.publish("/w", 1)
    message = str(err.value)
    assert f"{alive}: load_orbax_weights" in message and "busy" in message
    assert f"{dead}: load_orbax_weights" in message and "Connect" in message
