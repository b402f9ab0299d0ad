"""`simloop middleware` as users run it: the job starts its own agent server (`simloop serve`,
from the demo config), the official `anthropic` client talks to it, a rollout finished on the
admin socket with the token from `middleware-admin.json` (mode 0600; the API listener refuses
the same finish, and /metrics counts it) and an unfinished one (written `aborted` at SIGTERM)
land in `trajectories/` and `metrics.jsonl`; and `--dry-run --format json` lists the agent
server it would start, and itself."""

import http.client
import json
import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import pytest

from rl.data.trajectory import read_jsonl
from tests.fakes import free_port, user_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"
SMALL = ["--serve.engine.num_slots", "4", "--serve.engine.max_seq_len", "1024"]


def test_dry_run_lists_the_agent_server(tmp_path):
    cmd = [SIMLOOP, "middleware", "--config", "configs/demo_cpu.yaml", "--out", str(tmp_path),
           "--dry-run", "--format", "json"]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    processes = json.loads(proc.stdout)["processes"]
    assert [p["role"] for p in processes] == ["agent_serve", "middleware"]
    assert "serve" in processes[0]["command"] and "middleware" in processes[1]["command"]


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the middleware's admin listener)."""

    def __init__(self, path: str):
        super().__init__("middleware", timeout=60)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.socket_path)


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def test_middleware_job_serves_and_writes_trajectories(tmp_path):
    port = free_port()
    out = tmp_path / "mw"
    cmd = [SIMLOOP, "middleware", "--config", "configs/demo_cpu.yaml", "--out", str(out),
           "--middleware.port", str(port), *SMALL]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=user_env(cheap_compile=True),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        while True:  # until it listens (the agent server compiles first)
            line = lines.get(timeout=300)
            assert line is not None, "".join(seen)[-3000:]
            seen.append(line)
            if line.startswith("  finish:"):  # the banner's last line
                break
        url = f"http://127.0.0.1:{port}"
        client = anthropic.Anthropic(base_url=url, api_key="job-1", max_retries=0)
        m = client.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "ls"}]
        )
        assert m.usage.output_tokens >= 1
        left = anthropic.Anthropic(base_url=url, api_key="job-2", max_retries=0)
        left.messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
        # the API listener, where harnesses talk, does not finish rollouts
        request = urllib.request.Request(
            f"{url}/rollouts/job-1/finish", method="POST", data=json.dumps({"reward": 1.0}).encode()
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 404
        assert "not served here" in json.loads(refused.value.read())["error"]["message"]
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as r:
            metrics = r.read().decode()
        assert 'simloop_middleware_refused_finishes_total{listener="api"} 1' in metrics
        # the admin socket and its token, as the banner and middleware-admin.json give them
        note_path = out / "middleware-admin.json"
        assert stat.S_IMODE(os.stat(note_path).st_mode) == 0o600
        note = json.loads(note_path.read_text())
        banner = "".join(seen)
        assert f"--unix-socket {note['socket']}" in banner and str(note_path) in banner
        assert note["token"] not in banner
        admin = UnixHTTPConnection(note["socket"])
        admin.request("POST", "/rollouts/job-1/finish", body=json.dumps({"reward": 1.0}))
        assert admin.getresponse().status == 401  # no token
        admin = UnixHTTPConnection(note["socket"])
        admin.request(
            "POST",
            "/rollouts/job-1/finish",
            body=json.dumps({"reward": 1.0}),
            headers={"Authorization": f"Bearer {note['token']}"},
        )
        answer = admin.getresponse()
        finished = json.loads(answer.read())
        assert answer.status == 200 and finished["trajectories"] == 1 and finished["paths"]
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    while (line := lines.get(timeout=30)) is not None:
        seen.append(line)
    assert code == 0, "".join(seen)[-3000:]
    assert "1 of them unfinished" in "".join(seen)
    assert not (out / "middleware-admin.json").exists()  # the secret goes with the run
    trajs = [
        t for p in sorted((out / "trajectories").glob("middleware-*.jsonl")) for t in read_jsonl(p)
    ]
    assert {(t.rollout_id, t.status) for t in trajs} == {("job-1", "ok"), ("job-2", "aborted")}
    done = next(t for t in trajs if t.rollout_id == "job-1")
    assert done.reward == 1.0 and sum(done.loss_mask) == m.usage.output_tokens
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["rollout_id"] for r in records if r.get("stage") == "middleware") == [
        "job-1",
        "job-2",
    ]
