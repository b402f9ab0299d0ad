"""Shared test helpers: small real artifacts the tests build themselves (nothing from a hub)."""

import asyncio
import json
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rl.data.tokenizer import BYTE_SPECIALS, ENDOFTEXT, IM_END
from serving.client import ClientConfig, ClientError, InferenceClient
from serving.lifetime import SERVER_XLA_FLAGS_ENV

CORPUS = [
    "ls -la /tmp && cat notes.txt | sort | uniq -c",
    "def reverse(s):\n    return s[::-1]\n",
    'Traceback (most recent call last):\n  File "main.py", line 3, in <module>\n',
    "echo 'hello world' > out.txt; wc -l out.txt",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 日本語",
    "<tool_response>\nexit code 0\n</tool_response>",
]


def user_env(
    *, cheap_compile: bool = False, full_servers: bool = False, **extra: str
) -> dict[str, str]:
    """This process's environment as a user's shell would have it for a simloop command: no
    XLA_FLAGS (simloop plans its own fake devices, one per server). `cheap_compile` keeps the
    suite's cheap compile flags (tests/conftest.py; simloop passes them on to every process
    it starts): for short, compile-bound commands only. A 1-step train-agent costs 43 CPU
    seconds with them and 77 without; 100 warm-start steps run 1.8x slower with them (43 s
    instead of 24 s), more than their compiles save (2026-12-05). `full_servers` gives the
    servers the job starts XLA's full optimisation all the same (`SIMLOOP_SERVER_XLA_FLAGS`
    empty), for jobs whose episodes decode long enough to repay it: `demo --quick` and its
    gating experiment 299 -> 274 CPU seconds, while the harness, multi-process, bench and
    middleware tests went 428 -> 519 with it (2026-12-05)."""
    env = dict(os.environ)
    count = "--xla_force_host_platform_device_count"
    flags = [
        f for f in env.pop("XLA_FLAGS", "").split() if cheap_compile and not f.startswith(count)
    ]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    if full_servers:
        env[SERVER_XLA_FLAGS_ENV] = ""
    return {**env, **extra}


def tiny_agent_serve_args(tmp_path: Path, *, seed: int, context: int):
    """A random tiny model saved as an HF checkpoint, a run directory for `simloop serve`, and
    the serve flags that load it as `agent` (4 slots, `context` tokens): `(cfg, hf, run, args)`
    for `launch.deploy.local.LocalServer.start("agent", run, extra_args=args)`."""
    from flax import nnx

    from rl.model import Qwen3, save_hf, tiny

    cfg = tiny(initializer_range=0.2)
    hf = save_hf(cfg, Qwen3(cfg, rngs=nnx.Rngs(seed)), tmp_path / "hf")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    args = ["--model", str(hf), "--model-name", "agent", "--num-slots", "4",
            "--max-seq-len", str(context)]  # fmt: skip
    return cfg, hf, run, args


def build_hf_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE with Qwen-style ChatML specials; write tokenizer.json and
    tokenizer_config.json into `path` (an HF tokenizer directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BYTE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": IM_END,
                "pad_token": ENDOFTEXT,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
            }
        )
    )
    return path


class FakeAgentClient:
    """An in-memory agent server for orchestrator tests: plays `TextopsSolver` for whichever
    task's instruction is in the prompt, returns token ids / logprobs / versions like the real
    client, and records every reply so tests can check token-in/token-out."""

    def __init__(
        self,
        tasks,
        *,
        version: int = 0,
        fail_task: str | None = None,
        delay_s: float = 0.0,
        never_stop: bool = False,
    ):
        from rl.data import ByteTokenizer

        self.tok = ByteTokenizer()
        self.tasks = {t.instruction: t for t in tasks}
        self.version, self.fail_task, self.delay_s = version, fail_task, delay_s
        self.never_stop = never_stop
        self.replies: list[tuple[list[int], list[int]]] = []  # (prompt, generated)
        self.calls = 0

    async def complete(
        self,
        prompt,
        *,
        max_tokens,
        temperature=1.0,
        top_p=1.0,
        seed=None,
        logprobs=None,
        timeout_s=None,
        **_,
    ):
        import asyncio
        from types import SimpleNamespace

        from envs.textops import TextopsSolver
        from rl.data.tokenizer import IM_START

        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = self.tok.decode(prompt)
        task = next(t for instr, t in self.tasks.items() if instr in text)
        if task.id == self.fail_task:
            from serving.client import ClientError

            raise ClientError("POST /v1/completions -> 503: engine failed", status=503)
        solver = TextopsSolver(task)
        solver._step = text.count(f"{IM_START}assistant") - 1
        last_user = text.rsplit(f"{IM_START}user\n", 1)[-1]
        reply = solver.act(last_user)
        gen = self.tok.encode(reply)[: max_tokens - 1]
        if self.never_stop:
            gen = (self.tok.encode("x") * max_tokens)[:max_tokens]
        else:
            gen = gen + [self.tok.eos_id]
        self.replies.append((list(prompt), list(gen)))
        finish = "length" if self.never_stop else "stop"
        return SimpleNamespace(
            text=self.tok.decode([t for t in gen if t != self.tok.eos_id]),
            token_ids=gen,
            finish_reason=finish,
            logprobs=[-0.5] * len(gen),
            token_versions=[self.version] * len(gen),
            weight_version=self.version,
        )


async def wait_until(cond, timeout_s: float = 10.0, poll_s: float = 0.005) -> bool:
    """Poll `cond()` until it holds (True) or `timeout_s` passes (False)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    return True


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (with the `span - 1` after it).

    Drawn below the kernel's ephemeral range: a port from `bind(0)` lies inside it, where any
    outgoing connection may take it before a slow-starting server binds it (a fake vLLM
    binds ~15 s after its port is chosen, while the suite's other worker opens hundreds)."""
    import random

    high = _ephemeral_low() - span
    low = max(1024, high - 12_000)
    for _ in range(200):
        port = random.randint(low, high)
        try:
            for p in range(port, port + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {span} free consecutive ports on 127.0.0.1 in [{low}, {high}]")


@dataclass
class PlannedProcess:
    """The fields of `launch.deploy.chips.ProcessPlan` that server launchers read."""

    role: str
    chips: tuple[int, ...]
    http_port: int | None
    env: dict[str, str] = field(default_factory=dict)


class StepGate:
    """Holds the engine before each device step until the test grants it one: the engine is
    exactly as slow as the test needs, on any machine. Steps run in a worker thread
    (`asyncio.to_thread`), so a semaphore holds them; the event loop learns through
    `call_soon_threadsafe` that the engine is waiting for a grant."""

    def __init__(self, engine, monkeypatch):
        self._step = engine._device_step
        self._loop = asyncio.get_running_loop()
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self._waiting = asyncio.Event()
        monkeypatch.setattr(engine, "_device_step", self._gated)

    def _gated(self, *args):
        if not self._open.is_set():
            self._loop.call_soon_threadsafe(self._waiting.set)
            self._permits.acquire()
        return self._step(*args)

    async def engine_waits(self) -> None:
        """Until the engine is held before its next step (a guard, not a race: 60 s)."""
        await asyncio.wait_for(self._waiting.wait(), 60)
        self._waiting.clear()

    def grant(self) -> None:
        self._permits.release()

    def open(self) -> None:
        self._open.set()
        self._permits.release()


class RecordingClient(InferenceClient):
    """An `InferenceClient` that keeps every `(prompt, Completion)` it got (`calls`)."""

    def __init__(self, url: str):
        super().__init__(url)
        self.calls: list = []

    async def complete(self, prompt, **kw):
        out = await super().complete(prompt, **kw)
        self.calls.append((list(prompt), out))
        return out


class LossyClient(InferenceClient):
    """Loses the answer of a session's n-th generate call for each n in `lose` (counted per
    session) *after* the real server appended and generated: a connection reset on the way
    back, so the server's session is one turn ahead. Counts what it sent (`generates`,
    `rewinds`: each rewind's target) and what it lost (`lost`)."""

    def __init__(self, cfg: ClientConfig, lose: set[int]):
        super().__init__(cfg)
        self.lose, self.per_session = lose, {}
        self.generates, self.lost, self.rewinds = 0, 0, []

    async def request(self, method, path, **kw):
        if path.endswith("/rewind"):
            self.rewinds.append(kw["json_body"]["to"])
        answer = await super().request(method, path, **kw)
        if path.endswith("/generate"):
            sid = path.split("/")[3]  # /v1/sessions/{id}/generate
            self.generates += 1
            self.per_session[sid] = self.per_session.get(sid, 0) + 1
            if self.per_session[sid] in self.lose:
                self.lost += 1
                raise ClientError(f"{method} {path}: ServerDisconnectedError")  # retryable
        return answer


def assert_token_exact(calls, trajectory) -> None:
    """Each sampled turn of `trajectory` is a server's output ids, for a prompt equal to
    everything before it in the trajectory (the ids the sampler saw, spliced verbatim), with
    the server's logprobs and versions; `calls` as `RecordingClient.calls`."""
    for turn in trajectory.turns:
        a, b = turn.token_span
        matches = [
            out
            for prompt, out in calls
            if out.prompt_token_ids == trajectory.token_ids[:a] == prompt
        ]
        assert matches, f"no server request had the prompt of turn {turn.token_span}"
        # (several rollouts may have sent the same prompt: one of them sampled these ids)
        assert any(
            trajectory.token_ids[a:b] == out.token_ids
            and trajectory.behavior_logprobs[a:b] == out.logprobs
            and trajectory.policy_version[a:b] == out.token_versions
            for out in matches
        ), f"turn {turn.token_span}: no server answer to its prompt has its ids and logprobs"


CALC_BUGGY = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_TESTS = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
CALC_FIX = ("calc.py", "a - b", "a + b")
"""The one fix every instance of `swe_task_file` needs: replace in calc.py."""


def _git(repo, *args: str) -> str:
    import subprocess

    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def calc_repo(repo, source: str, tests: str):
    """A one-commit git repository at `repo`: `calc.py` and `tests/test_calc.py` -> (the
    repository's path, its commit)."""
    from pathlib import Path

    repo = Path(repo)
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(source)
    (repo / "tests" / "test_calc.py").write_text(tests)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "calc")
    return repo, _git(repo, "rev-parse", "HEAD").strip()


def swe_task_file(root, n: int = 1):
    """A JSONL task file of `n` SWE-bench-shaped instances on one small pytest repository
    (`calc`, whose `add` subtracts), each adding its own failing test of `add` in its
    `test_patch`, all fixed by `CALC_FIX`: -> (task file, repository, {instance: test_patch})."""
    import json
    import sys
    from pathlib import Path

    root = Path(root)
    repo, base = calc_repo(root / "calc", CALC_BUGGY, CALC_TESTS)
    lines, patches = [], {}
    for k in range(n):
        name = f"test_add_{k}"
        new = CALC_TESTS.replace("import mul", "import add, mul") + (
            f"\n\ndef {name}():\n    assert add({k}, 3) == {k + 3}\n"
        )
        (repo / "tests" / "test_calc.py").write_text(new)
        patch = _git(repo, "diff")
        (repo / "tests" / "test_calc.py").write_text(CALC_TESTS)
        patches[f"calc-{k}"] = patch
        lines.append(
            json.dumps(
                {
                    "instance_id": f"calc-{k}",
                    "repo": "local/calc",
                    "base_commit": base,
                    "problem_statement": f"add(a, b) returns a - b; add({k}, 3) must be {k + 3}.",
                    "test_patch": patch,
                    "FAIL_TO_PASS": [f"tests/test_calc.py::{name}"],
                    "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
                    "repo_path": "calc",
                    "test_cmd": f"{sys.executable} -m pytest -rA -p no:cacheprovider",
                }
            )
        )
    path = root / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, repo, patches
