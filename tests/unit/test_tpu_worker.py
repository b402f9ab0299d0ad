"""The TPU VM worker entry (`launch/deploy/tpu_worker.py`, what `simloop tpu-vm run --planned`
starts on every worker): which worker it is (the metadata server, or flags), and the
environment it starts each planned process with, the multi-process contract above all."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launch.deploy import tpu_worker

REPO = Path(__file__).resolve().parents[2]
V6E_32 = REPO / "configs" / "v6e-32.yaml"
V6E_8 = REPO / "configs" / "v6e-8.yaml"
ADDRESSES = [f"10.0.0.{i}" for i in range(2, 10)]
CONTRACT = ("SIMLOOP_COORDINATOR", "SIMLOOP_NUM_PROCESSES", "SIMLOOP_PROCESS_ID")


def _dry_run(capsys, index: int, *extra: str) -> list[dict]:
    argv = ["--config", str(V6E_32), "--worker-index", str(index), "--worker-addresses",
            ",".join(ADDRESSES), *extra, "--dry-run", "--", "true"]  # fmt: skip
    assert tpu_worker.main(argv) == 0
    return json.loads(capsys.readouterr().out)["processes"]


def test_endpoints_in_both_of_the_metadata_servers_forms():
    assert tpu_worker.parse_endpoints("t1v-n-1-w-0:0:10.0.0.2,t1v-n-1-w-1:1:10.0.0.3") == [
        "10.0.0.2",
        "10.0.0.3",
    ]
    assert tpu_worker.parse_endpoints("w-0.internal, w-1.internal") == [
        "w-0.internal",
        "w-1.internal",
    ]
    with pytest.raises(ValueError, match="NAME:ID:ADDRESS"):
        tpu_worker.parse_endpoints("a:b")


def test_each_trainer_process_on_the_workers_gets_the_process_contract(capsys):
    """v6e-32: policy_train on workers 0-3 and sim_train on 4-5 are jobs of 4 and 2
    processes (ids in worker order, one coordinator: the group's first worker's address);
    the servers on workers 6-7 get no contract."""
    seen = {}
    for i in range(8):
        for p in _dry_run(capsys, i):
            seen.setdefault(p["role"], []).append((i, {k: p["env"].get(k) for k in CONTRACT}))
            assert p["env"]["SIMLOOP_ROLE"] == p["role"]
            assert p["env"]["SIMLOOP_CONFIG"].endswith("config.yaml")
    for role, workers, port in (("policy_train", [0, 1, 2, 3], 8480), ("sim_train", [4, 5], 8481)):
        assert [i for i, _ in seen[role]] == workers
        assert [c for _, c in seen[role]] == [
            {
                "SIMLOOP_COORDINATOR": f"{ADDRESSES[workers[0]]}:{port}",
                "SIMLOOP_NUM_PROCESSES": str(len(workers)),
                "SIMLOOP_PROCESS_ID": str(rank),
            }
            for rank in range(len(workers))
        ]
    for role in ("agent_serve", "sim_serve"):
        assert [c for _, c in seen[role]] == [dict.fromkeys(CONTRACT)]


def test_a_one_host_slice_needs_no_metadata_and_gets_no_contract(capsys):
    argv = ["--config", str(V6E_8), "--dry-run", "--", "true"]
    # The metadata server is never asked: this one is unreachable.
    assert tpu_worker.main(argv, metadata_url="http://127.0.0.1:9/") == 0
    procs = json.loads(capsys.readouterr().out)["processes"]
    assert sorted(p["role"] for p in procs) == [
        "agent_serve",
        "agent_serve",
        "policy_train",
        "sim_serve",
        "sim_serve",
    ]
    assert not any(k in p["env"] for p in procs for k in CONTRACT)
    (trainer,) = [p for p in procs if p["role"] == "policy_train"]
    assert trainer["env"]["TPU_PROCESS_ADDRESSES"] == "localhost:8476"


class _Metadata(http.server.BaseHTTPRequestHandler):
    """A TPU VM metadata server: worker 5 of the slice, answering Metadata-Flavor requests."""

    values = {
        "agent-worker-number": "5",
        "worker-network-endpoints": ",".join(
            f"t1v-n-ab-w-{i}:{i}:{a}" for i, a in enumerate(ADDRESSES)
        ),
    }

    def do_GET(self):
        key = self.path.rsplit("/", 1)[-1]
        ok = self.headers.get("Metadata-Flavor") == "Google" and key in self.values
        body = self.values[key].encode() if ok else b"not found"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metadata_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metadata)
    thread = threading.Thread(target=server.serve_forever, name="fake-metadata", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/computeMetadata/v1/instance/attributes/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_the_worker_reads_who_it_is_from_the_metadata_server(capsys, metadata_url):
    argv = ["--config", str(V6E_32), "--dry-run", "--", "true"]
    assert tpu_worker.main(argv, metadata_url=metadata_url) == 0
    (proc,) = json.loads(capsys.readouterr().out)["processes"]
    assert proc["role"] == "sim_train" and proc["rank"] == 1
    assert proc["env"]["SIMLOOP_COORDINATOR"] == f"{ADDRESSES[4]}:8481"
    assert proc["env"]["TPU_PROCESS_ADDRESSES"] == f"{ADDRESSES[4]}:8477,{ADDRESSES[5]}:8477"


def test_without_metadata_or_flags_it_says_what_to_pass(capsys):
    argv = ["--config", str(V6E_32), "--", "true"]
    assert tpu_worker.main(argv, metadata_url="http://127.0.0.1:9/") == 2
    err = capsys.readouterr().err
    assert "cannot tell which TPU VM worker this is" in err and "--worker-index" in err
    wrong = ["--config", str(V6E_32), "--worker-index", "0", "--worker-addresses", "a,b", "--",
             "true"]  # fmt: skip
    assert tpu_worker.main(wrong) == 2
    assert "2 hostnames for a v6e-32 with 8 hosts" in capsys.readouterr().err


# A trainer that records its contract and the config it was handed into $OUT/<id>.json.
_REPORT = (
    "import json, os, yaml; e = os.environ; cfg = yaml.safe_load(open(e['SIMLOOP_CONFIG'])); "
    "open(os.path.join(e['OUT'], e['SIMLOOP_PROCESS_ID'] + '.json'), 'w').write(json.dumps("
    "{**{k: e[k] for k in ('SIMLOOP_COORDINATOR', 'SIMLOOP_NUM_PROCESSES', 'SIMLOOP_PROCESS_ID',"
    " 'SIMLOOP_ROLE')}, 'seed': cfg['run']['seed']}))"
)


def test_two_workers_of_one_trainer_group_start_one_job(tmp_path):
    """Workers 4 and 5 (sim_train of v6e-32), run at once as `tpu-vm run --planned` runs them,
    start their trainer with the same coordinator and ids 0 and 1, and hand it the config
    with the command line's overrides applied."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}
    entry = [sys.executable, "-m", "launch.deploy.tpu_worker", "--config", str(V6E_32),
             "--run.seed", "7", "--worker-addresses", ",".join(ADDRESSES),
             "--libtpu-lockfile", str(tmp_path / "libtpu_lockfile")]  # fmt: skip
    command = ["--", sys.executable, "-c", _REPORT]
    run = {"env": env, "stderr": subprocess.PIPE, "text": True}
    workers = [
        subprocess.Popen([*entry, "--worker-index", str(i), *command], **run) for i in (4, 5)
    ]
    logs = [w.communicate(timeout=120)[1] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    seen = [json.loads((out / f"{i}.json").read_text()) for i in range(2)]
    assert seen == [
        {
            "SIMLOOP_COORDINATOR": f"{ADDRESSES[4]}:8481",
            "SIMLOOP_NUM_PROCESSES": "2",
            "SIMLOOP_PROCESS_ID": str(i),
            "SIMLOOP_ROLE": "sim_train",
            "seed": 7,
        }
        for i in range(2)
    ]


def test_a_closing_ssh_session_stops_the_workers_processes(tmp_path):
    """SIGHUP (the terminal of `tpu-vm run --planned` going away) stops the trainer, which
    runs in a session of its own, and the worker exits 128 + SIGTERM."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}
    trainer = (
        "import os, time; open(os.path.join(os.environ['OUT'], 'pid'), 'w')"
        ".write(str(os.getpid())); time.sleep(120)"
    )
    argv = [sys.executable, "-m", "launch.deploy.tpu_worker", "--config", str(V6E_32),
            "--worker-index", "4", "--worker-addresses", ",".join(ADDRESSES), "--grace-s", "5",
            "--libtpu-lockfile", "", "--", sys.executable, "-c", trainer]  # fmt: skip
    worker = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        pid_file = out / "pid"
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert worker.poll() is None, worker.communicate()[1]
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        worker.send_signal(signal.SIGHUP)
        assert worker.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
