"""The local launcher: `simloop serve` subprocesses for jobs that need a server and were not
given one (`agent.server_url` / `simulator.server_url` unset).

    with LocalServer.start("agent", run_dir) as server:
        server.url   # http://127.0.0.1:PORT, healthy

Each server reads the run directory's resolved `config.yaml`, so it builds exactly the model
the config names, logs to `<run>/logs/<role>-server.log`, and is stopped (SIGTERM, then SIGKILL
after a grace period) when the block exits, on every path.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

LISTENING = re.compile(r"listening on (http://[\w.\-]+:\d+)")


class LocalServer:
    def __init__(self, role: str, proc: subprocess.Popen, url: str, log_path: Path):
        self.role, self.proc, self.url, self.log_path = role, proc, url, log_path

    @classmethod
    def start(cls, role: str, run_dir: str | os.PathLike, *, extra_args: list[str] = (),
              timeout_s: float = 300.0, port: int = 0, env: dict[str, str] | None = None,
              name: str | None = None) -> LocalServer:  # fmt: skip
        """Start `simloop serve --role ROLE` on `port` (0: a free one) and wait until it
        listens. `env` is laid over this process's environment (a chip plan's process env);
        `name` names the log file (default: the role)."""
        run_dir = Path(run_dir)
        log_path = run_dir / "logs" / f"{name or role}-server.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "launch", "serve", "--config", str(run_dir / "config.yaml"),
               "--role", role, "--port", str(port), *extra_args]  # fmt: skip
        log = log_path.open("w")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True,
                                env=None if env is None else {**os.environ, **env})  # fmt: skip
        deadline = time.monotonic() + timeout_s
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                break
            log.write(line)
            log.flush()
            m = LISTENING.search(line)
            url = m.group(1) if m else None
            if time.monotonic() > deadline:
                break
        if url is None:
            proc.kill()
            proc.wait(timeout=10)
            log.close()
            tail = "".join(log_path.read_text().splitlines(keepends=True)[-15:])
            raise RuntimeError(f"the {role} server did not start (log {log_path}):\n{tail}")
        log.close()
        return cls(role, proc, url, log_path)

    def stop(self, grace_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=10)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
