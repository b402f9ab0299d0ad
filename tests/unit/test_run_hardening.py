"""Runs and configs under hostile input (issue 17, "Checkpoints and runs"): non-finite numbers
and booleans-as-counts fail validation, absurd sizes fail with ranges or with the memory they
would need, an episode context larger than the server's is caught before anything starts, a
run directory belongs to one live job at a time, and a failed weight publish is retried or
stops RL with a clear error. Locks are held by real processes; the publisher talks to a real
aiohttp server on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig, check_local_servers
from rl.data.rundir import LOCK, RunDirInUse, lock_run_dir
from serving.client import ClientConfig, InferenceClient
from serving.publisher import EnginePublisher, PublishError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo_cpu.yaml"


# ----- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train_sim.optim.lr", "nan", r"'train_sim.optim.lr'=nan is invalid: a finite number"),
        ("train_agent.optim.lr", ".inf", r"'train_agent.optim.lr'=inf is invalid: a finite"),
        ("train_agent.loss.kl_coef", ".inf", r"kl_coef'=inf is invalid: a finite"),
        ("orchestrator.temperature", ".nan", r"'orchestrator.temperature'=nan is invalid"),
        ("train_sim.steps", "true", r"'train_sim.steps'=True is invalid: a number, not true"),
        ("train_agent.steps", "true", r"'train_agent.steps'=True is invalid"),
        ("serve.engine.num_slots", "true", r"num_slots'=True is invalid"),
        ("eval_sim.context_edges", "[true, 8]", r"context_edges'=\[True, 8\] is invalid"),
        ("serve.engine.num_slots", str(10**30), r"num_slots=10+ is invalid: an integer in"),
        ("serve.engine.max_seq_len", "1000000000", r"max_seq_len=1000000000 is invalid: an int"),
        ("serve.engine.num_slots", "1e30", r"num_slots"),
    ],
)
def test_validation_rejects_non_finite_numbers_bools_and_absurd_sizes(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SimloopConfig, DEMO, [f"--{key}", value])


def test_an_episode_context_beyond_the_server_is_caught_before_starting():
    cfg = load_config(
        SimloopConfig,
        DEMO,
        ["--orchestrator.max_context_tokens", "4096", "--serve.engine.max_seq_len", "2048"],
    )
    with pytest.raises(
        ValueError,
        match=r"max_context_tokens=4096 is invalid: at most "
        r"serve.engine.max_seq_len \(2048\)",
    ):
        check_local_servers(cfg, ["agent"])
    check_local_servers(cfg, [])  # no server of this job's own: nothing to compare with
    # a compacting session keeps fewer keys than its episode has tokens: allowed
    compacting = load_config(SimloopConfig, DEMO, [
        "--orchestrator.max_context_tokens", "4096", "--serve.engine.max_seq_len", "2048",
        "--orchestrator.sessions", "true", "--orchestrator.session_compaction",
        "{mode: markovian}"])  # fmt: skip
    check_local_servers(compacting, ["agent"])
    sim = load_config(
        SimloopConfig,
        DEMO,
        [
            "--env.shell.simulated.max_context_tokens",
            "3000",
            "--env.shell.simulated.max_tokens",
            "64",
        ],
    )
    with pytest.raises(ValueError, match=r"simulated.max_context_tokens=3000"):
        check_local_servers(sim, ["simulator"])
    check_local_servers(load_config(SimloopConfig, DEMO), ["agent", "simulator"])


def test_sizes_the_machine_cannot_hold_say_how_much_they_need():
    huge = ["--serve.engine.num_slots", "65536", "--serve.engine.max_seq_len", "1048576",
            "--orchestrator.max_context_tokens", "1024"]  # fmt: skip
    cfg = load_config(SimloopConfig, DEMO, huge)
    with pytest.raises(
        ValueError,
        match=r"needs about [0-9.]+ GiB \(agent server parameters "
        r".*KV cache [0-9.]+ GiB.*\) but this machine has",
    ):
        check_local_servers(cfg, ["agent"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--orchestrator.max_context_tokens", "4096"], "max_context_tokens=4096 is invalid"),
        # the server would lag the trainer by up to 2 versions: tokens 3 stale under S = 1
        (
            ["--train_agent.publish_every", "3", "--orchestrator.max_staleness", "1"],
            "publish_every=3 is invalid",
        ),
        # the demo's policy trainer splits each step's rows over 4 devices
        (
            ["--orchestrator.batch_size", "6", "--orchestrator.group_size", "2"],
            "orchestrator.batch_size=6 does not split over the policy trainer's 4 data-parallel"
            " devices (agent.mesh data x fsdp) x train_agent.optim.grad_accum 1: use a multiple "
            "of 4",
        ),
    ],
)
def test_train_agent_cli_refuses_impossible_settings_before_starting(tmp_path, overrides, message):
    out = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "launch", "train-agent", "--config", str(DEMO), "--out", str(out),
         "--orchestrator.max_staleness", "0", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


def test_a_server_that_does_not_start_ends_the_job_in_one_message(tmp_path):
    """The simulator's server exits at start (its weights are not there): eval-sim ends with
    exit 1 and says which server, where its log is and what it said, with no traceback."""
    from rl.data.trajectory import Trajectory, Turn, write_jsonl

    turn = Turn(agent_text="echo hi", command="echo hi", observation="hi\n", exit_code=0)
    write_jsonl(
        tmp_path / "real" / "shard.jsonl",
        [
            Trajectory(
                task_id="t0", turns=[turn], arm="real", env_backend="local", status="ok", reward=0.0
            )
        ],
    )
    r = subprocess.run(
        [sys.executable, "-m", "launch", "eval-sim", "--config", str(DEMO), "--out",
         str(tmp_path / "run"), "--simulator.weights", str(tmp_path / "no-such-weights"),
         "--eval_sim.trajectories", f"[{tmp_path / 'real'}]"],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "the simulator server did not start (log " in r.stderr
    assert "no-such-weights" in r.stderr  # the server's own reason, from its log
    assert "Traceback" not in r.stderr


# ----- one live job per run directory ----------------------------------------------------------

HOLD = """
import sys, time
from rl.data.rundir import lock_run_dir
lock_run_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(60)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_job_on_a_run_directory_fails_at_once_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = _holder(run_dir)
    try:
        with pytest.raises(RunDirInUse, match=rf"in use by another job \(pid {holder.pid} "):
            lock_run_dir(run_dir)
        began = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "launch", "train-sim", "--config", str(DEMO), "--out",
             str(run_dir), "--train_sim.trajectories", "[x]"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert time.monotonic() - began < 60
        assert r.returncode != 0 and f"pid {holder.pid}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and not (run_dir / "config.yaml").exists()
        # A nested run directory (a demo stage) is another directory with its own lock.
        lock_run_dir(run_dir / "collect")
    finally:
        holder.kill()
        holder.wait()
    # The holder died (SIGKILL): its lock died with it.
    lock_run_dir(run_dir)
    assert (run_dir / LOCK).read_text().startswith(f"{os.getpid()} ")
    lock_run_dir(run_dir)  # the same process again: a no-op


# ----- publishing weights ----------------------------------------------------------------------


@pytest_asyncio.fixture
async def admin_server():
    """A server whose /admin/load_weights answers from a script of statuses."""
    runners = []

    async def start(statuses: list[int]):
        calls: list[int] = []

        async def load(request: web.Request) -> web.Response:
            body = await request.json()
            status = statuses[min(len(calls), len(statuses) - 1)]
            calls.append(body["version"])
            if status == 200:
                return web.json_response({"version": body["version"]})
            err = {
                "message": f"load failed ({status})",
                "type": "error",
                "param": None,
                "code": None,
            }
            return web.json_response({"error": err}, status=status)

        app = web.Application()
        app.router.add_post("/admin/load_weights", load)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        return calls, InferenceClient(ClientConfig(f"http://127.0.0.1:{port}", max_retries=0))

    yield start
    for r in runners:
        await r.cleanup()


async def test_a_transiently_failing_publish_is_retried(admin_server):
    calls, client = await admin_server([503, 503, 200])
    async with client:
        pub = EnginePublisher([client], token="t", probe=False, retries=2, backoff_s=0.01)
        report = await pub.publish("/ckpt/v2", 2)
    assert report.version == 2 and calls == [2, 2, 2]


@pytest.mark.parametrize("statuses, attempts", [([503], 3), ([400], 1)])
async def test_a_publish_that_keeps_failing_stops_with_a_clear_error(
    admin_server, statuses, attempts
):
    calls, client = await admin_server(statuses)
    async with client:
        pub = EnginePublisher([client], token="t", probe=False, retries=2, backoff_s=0.01)
        with pytest.raises(
            PublishError,
            match=rf"publishing version 5 \(/ckpt/v5\) to http://"
            rf"127.0.0.1:\d+ failed after {attempts} ",
        ):
            await pub.publish("/ckpt/v5", 5)
    assert len(calls) == attempts
