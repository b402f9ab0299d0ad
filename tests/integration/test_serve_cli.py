"""`simloop serve` as a user runs it: the installed script on a free port, a real request, and
a clean shutdown on SIGTERM."""

import json
import re
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.fakes import user_env

REPO = Path(__file__).resolve().parents[2]
SIMLOOP = Path(sys.executable).parent / "simloop"


def _readline(proc: subprocess.Popen, deadline: float) -> str:
    """One stdout line, or '' at EOF; fails at the deadline."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError("simloop serve printed nothing in time")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            return proc.stdout.readline()


def _request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_simloop_serve_answers_and_stops_on_sigterm(tmp_path):
    env = user_env(cheap_compile=True)  # one CPU device, as a user
    env["JAX_PLATFORMS"] = "cpu"
    stderr = (tmp_path / "serve.err").open("w")
    proc = subprocess.Popen(
        [SIMLOOP, "serve", "--preset", "tiny", "--port", "0", "--max-seq-len", "256",
         "--num-slots", "4", "--serve.engine.prefill_chunk", "32",  # fewer shapes to compile
         "--speculate", "4"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "listening on" not in line:
            line = _readline(proc, deadline)
            assert line or proc.poll() is None, (tmp_path / "serve.err").read_text()[-3000:]
        match = re.search(r"listening on (http://127\.0\.0\.1:(\d+))", line)
        assert match and int(match.group(2)) > 0, line
        assert "'tiny'" in line and "4 slots" in line
        url = match.group(1)

        status, out = _request(
            f"{url}/v1/completions", {"prompt": "ls", "max_tokens": 5, "ignore_eos": True}
        )
        assert status == 200, out
        assert out["model"] == "tiny" and out["usage"]["completion_tokens"] == 5
        assert out["choices"][0]["finish_reason"] == "length"
        status, out = _request(f"{url}/v1/completions", {"prompt": "ls", "max_tokens": 256})
        assert status == 400 and out["error"]["param"] == "max_tokens"  # --max-seq-len took
        status, out = _request(f"{url}/health")
        assert status == 200 and out["status"] == "ok"
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        assert re.search(r"^simloop_spec_kept_total \d+$", metrics, re.M), metrics

        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=15)
        rest = proc.stdout.read()
        assert rc == 0, (tmp_path / "serve.err").read_text()[-3000:]
        # its summary line: requests, tokens, and what --speculate 4 did
        assert re.search(
            r"simloop serve: stopped \(\d+ requests, 5 tokens generated in \d+ "
            r"device steps; \d+ verify calls kept \d+ of \d+ guessed",
            rest,
        ), rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
