"""One episode, token-in / token-out.

Agent episodes (arms `real` and `closed_loop`): the episode's token ids go to the agent server
as the prompt; the generated ids, their logprobs and weight versions are kept verbatim; the
reply's text goes to the terminal env; the env's answer is rendered append-only and its ids
appended with loss mask 0. Nothing is ever re-tokenised, so the trainer sees exactly what the
sampler saw.

Replay episodes (arm c): the commands of a recorded real trajectory are sent to the simulated
shell; each turn keeps the real and the simulated observation side by side.

Every abnormal end is a `status` with a `reason`: a server that keeps failing (`error`), a
request timeout or the episode's wall-clock guard (`timeout`), a full context (`truncated`),
cancellation at shutdown or a server replica that went down under the episode (`aborted`,
`replica_down` names it). A partial episode is never marked `ok`.

Each episode runs in a `serving.pool.pinned` scope: a `ReplicaPool` handed in as the agent
client (or behind the simulated shell) keeps all of the episode's requests on one replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from envs.backends import ShellFactory
from envs.config import TerminalConfig
from envs.fidelity import compare_observations
from envs.tasks import Task
from envs.terminal import TrialEnv
from rl.data.chat import ChatRenderer, Message
from rl.data.trajectory import Trajectory, Trial, Turn, render_token_view
from rl.orchestrator.config import OrchestratorConfig
from serving.pool import Affinity, pinned

SHELL_FLAGS = ("cap_hit", "think_leak", "repetition", "empty", "malformed", "timeout")
ENV_STATUS = {
    "submitted": "ok",
    "max_turns": "truncated",
    "max_observation_chars": "truncated",
    "format_errors": "truncated",
    "trial_timeout": "truncated",
    "error": "error",
}


class AgentClient(Protocol):
    """What an agent turn needs of the inference client (`serving.client.InferenceClient`)."""

    async def complete(
        self,
        prompt: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
        timeout_s: float | None = None,
    ) -> Any: ...


@dataclass
class EpisodeSpec:
    task: Task
    arm: str
    """`real` or `closed_loop` (agent episodes)."""
    env_backend: str
    group_id: str
    index: int = 0
    """Position in the group."""
    seed: int | None = None
    admitted_version: int = 0
    """Trainer version when the episode was admitted (for staleness accounting)."""


@dataclass
class TurnTiming:
    """Per-turn numbers the rollout metrics aggregate."""

    turn: int
    agent_s: float
    env_s: float
    generated: int


@dataclass
class EpisodeResult:
    trajectory: Trajectory
    timings: list[TurnTiming] = field(default_factory=list)


class _Fatal(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def _classify(e: Exception) -> tuple[str, str]:
    # serving.client.ClientTimeout is a TimeoutError: no import of serving needed here.
    if isinstance(e, TimeoutError):
        return "timeout", f"agent request timed out: {e}"
    return "error", f"agent request failed: {type(e).__name__}: {e}"


async def run_agent_episode(
    spec: EpisodeSpec,
    client: AgentClient,
    shell_factory: ShellFactory,
    renderer: ChatRenderer,
    cfg: OrchestratorConfig,
    terminal: TerminalConfig,
    *,
    version_hint: Callable[[], int] = lambda: 0,
) -> EpisodeResult:
    """Run one agent episode to its end; always returns a trajectory (never raises for
    episode-level faults)."""
    traj = Trajectory(
        task_id=spec.task.id,
        arm=spec.arm,
        env_backend=spec.env_backend,
        status="aborted",
        reason="not started",
        group_id=spec.group_id,
        instruction=spec.task.instruction,
        setup_files=dict(spec.task.setup.files),
        tokenizer=type(renderer.tokenizer).__name__,
        group_index=spec.index,
        admitted_version=spec.admitted_version,
        task_kind=spec.task.kind,
    )
    result = EpisodeResult(traj)
    env = TrialEnv(spec.task, shell_factory, terminal)
    with pinned(f"{spec.group_id}-ep{spec.index}") as affinity:
        try:
            async with asyncio.timeout(cfg.episode_timeout_s):
                async with env:  # each trial's shell is closed when it ends, the last here
                    await _agent_loop(spec, client, env, renderer, cfg, result, version_hint)
        except _Fatal as e:
            traj.status, traj.reason = e.status, e.reason
        except TimeoutError:
            traj.status = "timeout"
            traj.reason = f"episode exceeded its {cfg.episode_timeout_s:g}s wall-clock guard"
        except asyncio.CancelledError:
            traj.status, traj.reason = "aborted", "cancelled (rollout shutting down)"
        except Exception as e:  # noqa: BLE001 - a broken shell/env ends this episode, not the run
            traj.status, traj.reason = "error", f"{type(e).__name__}: {e}"
    _blame_replica(traj, affinity)
    if traj.status != "ok" and traj.status != "truncated":
        traj.reward, traj.task_reward, traj.shaping = None, None, {}
    if terminal.trials > 1:
        traj.trials = _trials(env.trials, traj)
        traj.trial_reward = terminal.trial_reward
    return result


def _trials(records: list[dict], traj: Trajectory) -> list[Trial]:
    """The env's trial records as the trajectory's `trials`; a trial the episode's end cut
    short takes the episode's status and reason, and every trial covers its turns."""
    out = []
    for k, r in enumerate(records):
        last = k == len(records) - 1
        end = len(traj.turns) if last else r["end_turn"]
        if r["status"] == "running":  # interrupted: aborted, timed out, ...
            status, reason, reward = traj.status, traj.reason, None
            if status == "ok":  # cannot happen: the episode ended inside this trial
                status, reason = "error", "the episode ended inside the trial"
        else:
            status = ENV_STATUS.get(r["status"], "error")
            reason = None if status == "ok" else (r.get("reason") or r["status"])
            reward = r["reward"]
        out.append(
            Trial(
                index=k,
                start_turn=r["start_turn"],
                end_turn=end,
                reward=reward,
                status=status,
                reason=reason,
                workspace_hash=r["workspace_hash"],
            )
        )
    return out


class _SessionTurns:
    """The agent's turns through one session (`orchestrator.sessions`): each call appends
    what the episode's token stream gained since the session last saw it. A call whose answer
    was lost (connection error, 5xx, 429) is retried from the turn boundary: the client
    rewinds the session to what it held before the call and appends again.

    A session the server forgot (its TTL, memory pressure, a restart, a pool replica that died:
    404 / 409; an episode's calls are sequential, so 409 is never "busy") is opened again (by a
    pool, on a live replica) and sent the whole episode so far; the trajectory's meta records
    each reopen and why (`session_reopened`, `session_reopen_reasons`). Without compaction
    that is exact: plain causal attention either way. After a compaction it is not what the
    first session computed: the new one recomputes the earlier tokens' keys with everything in
    view. The episode records a context reset there (`Trajectory.context_resets`: the whole
    prefix re-sent), which training replays as a second segment of the row, so it stays
    trainable and exact. Sessions a client keeps for a server without them (vLLM,
    `serving.token_sessions`) report their own resets (each call that dropped a turn)."""

    def __init__(self, client, session_id: str, compaction=None):
        self.client, self.id, self.held = client, session_id, 0
        self.compaction = compaction
        self.epochs: list[dict] = []
        """What the server's compaction let each token see (`Trajectory.kv_epochs`)."""
        self.resets: list[dict] = []
        """Where the server computed the episode afresh (`Trajectory.context_resets`)."""
        self.reopened = 0
        self.reopen_reasons: list[str] = []
        """Why each reopen happened (the server forgot the session; its replica died)."""
        self._floor = 0
        """Epochs the server reports from before the last reopen (the new session's first,
        plain one) are not news."""

    def _compacted(self) -> bool:
        return bool(self.resets) or any(ep["start"] > 0 for ep in self.epochs)

    async def complete(self, ids: list[int], **kw) -> Any:
        kw.pop("logprobs", None)
        try:
            out = await self.client.session_generate(
                self.id, ids[self.held :], logprobs=0, rewind_to=self.held, **kw
            )
        except Exception as e:
            if getattr(e, "status", None) not in (404, 409):
                raise
            sid = await self.client.open_session(compaction=self.compaction)
            if sid is None:
                raise
            self.id, self.held, self.reopened = sid, 0, self.reopened + 1
            self.reopen_reasons.append(str(e)[:300])
            if self._compacted():
                self.resets.append({"start": len(ids), "context": [[0, len(ids)]]})
            self._floor = len(ids)
            out = await self.client.session_generate(
                self.id, list(ids), logprobs=0, rewind_to=0, **kw
            )
        self.held = len(ids) + len(out.token_ids)
        raw = out.raw if isinstance(out.raw, dict) else {}
        reset = raw.get("context_reset")
        if isinstance(reset, dict) and (not self.resets or reset != self.resets[-1]):
            self.resets = [r for r in self.resets if r["start"] < reset["start"]] + [reset]
        epoch = raw.get("kv_epoch")
        if isinstance(epoch, dict) and self._floor and epoch.get("start", 0) < self._floor:
            epoch = None  # the reopened session's own view of what it was sent: nothing new
        if isinstance(epoch, dict) and (not self.epochs or epoch != self.epochs[-1]):
            # a later start is a compaction; an earlier one a rewind back into history
            self.epochs = [e for e in self.epochs if e["start"] < epoch["start"]] + [epoch]
        return out

    def kv_epochs(self) -> list[dict]:
        """The epochs, or [] when nothing was ever compacted (one epoch from 0: plain causal
        attention)."""
        compacted = any(e["start"] > 0 for e in self.epochs)
        return [dict(e) for e in self.epochs] if compacted else []

    async def close(self) -> None:
        try:
            await self.client.close_session(self.id)
        except Exception:  # noqa: BLE001 - a server that is gone forgets it anyway (TTL)
            pass


async def _agent_loop(spec, client, env: TrialEnv, renderer, cfg, result, version_hint):
    session = None
    if cfg.sessions and hasattr(client, "open_session"):
        compaction = None
        if cfg.session_compaction:
            from serving.client import SessionCompaction

            compaction = SessionCompaction.from_json(cfg.session_compaction)
        sid = await client.open_session(compaction=compaction)
        session = None if sid is None else _SessionTurns(client, sid, compaction)
    try:
        await _agent_turns(spec, session or client, env, renderer, cfg, result, version_hint)
    finally:
        if session is not None:
            result.trajectory.kv_epochs = session.kv_epochs()
            result.trajectory.context_resets = [dict(r) for r in session.resets]
            if session.reopened:
                result.trajectory.meta["session_reopened"] = session.reopened
                result.trajectory.meta["session_reopen_reasons"] = session.reopen_reasons
            await asyncio.shield(session.close())


async def _agent_turns(spec, client, env: TrialEnv, renderer, cfg, result, version_hint):
    traj = result.trajectory
    first: Message = {"role": "user", "content": await env.reset()}
    traj.prompt = [first]
    ids = renderer.render([first], add_generation_prompt=True, enable_thinking=cfg.enable_thinking)
    traj.token_ids, traj.loss_mask = list(ids), [0] * len(ids)
    traj.behavior_logprobs, traj.policy_version = [None] * len(ids), [None] * len(ids)
    eos = renderer.im_end_id
    for turn_index in range(env.max_turns + 1):
        budget = min(cfg.max_tokens_per_turn, cfg.max_context_tokens - len(traj.token_ids))
        if budget <= 0:
            raise _Fatal(
                "truncated",
                f"context full ({len(traj.token_ids)} of "
                f"{cfg.max_context_tokens} tokens) before turn {turn_index}",
            )
        seed = None if spec.seed is None else (spec.seed * 1000 + turn_index) % 2**31
        started = time.perf_counter()
        try:
            out = await client.complete(
                list(traj.token_ids),
                max_tokens=budget,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                seed=seed,
                logprobs=0,
                timeout_s=cfg.request_timeout_s,
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - mapped to the episode's status
            raise _Fatal(*_classify(e)) from e
        agent_s = time.perf_counter() - started
        gen = list(out.token_ids)
        if out.finish_reason == "abort":
            raise _Fatal("aborted", "the agent server aborted the request")
        if not gen:
            raise _Fatal("error", "the agent server returned no tokens")
        logprobs = out.logprobs
        if logprobs is None or len(logprobs) != len(gen):
            got = None if logprobs is None else len(logprobs)
            raise _Fatal("error", f"the agent server returned {got} logprobs for {len(gen)} tokens")
        versions = out.token_versions
        if versions is None or len(versions) != len(gen):
            v = out.weight_version if out.weight_version is not None else version_hint()
            versions = [v] * len(gen)
        span = (len(traj.token_ids), len(traj.token_ids) + len(gen))
        traj.token_ids += gen
        traj.loss_mask += [1] * len(gen)
        traj.behavior_logprobs += [float(x) for x in logprobs]
        traj.policy_version += [int(v) for v in versions]
        flags = []
        if gen[-1] != eos:  # cut at max_tokens: close the turn (a token nobody sampled: mask 0)
            flags.append("agent_cap_hit")
            _append_env(traj, [eos])
        text = out.text
        # The turn owns its generated tokens from here on, whatever the env step does (a shell
        # that raises, a cancellation): a trajectory never holds sampled tokens outside a turn.
        turn = Turn(
            agent_text=text,
            command=None,
            observation=None,
            exit_code=None,
            timings={"agent_s": agent_s},
            flags=flags,
            token_span=span,
            info={"finish_reason": out.finish_reason},
        )
        traj.turns.append(turn)
        started = time.perf_counter()
        step = await env.step(text)
        env_s = time.perf_counter() - started
        info = step.info
        shell_info = info.get("shell") or {}
        flags += [k for k in SHELL_FLAGS if shell_info.get(k)]
        if "format_error" in info:
            flags.append("format_error")
        turn.command, turn.exit_code = info.get("command"), info.get("exit_code")
        turn.timings["env_s"] = env_s
        # The turn keeps the shell's raw output (what a simulator must reproduce, as in
        # imported trajectories); the rendered message the agent saw is in env_messages.
        if "output" in info:
            turn.observation = info["output"]
        result.timings.append(TurnTiming(turn_index, agent_s, env_s, len(gen)))
        if "trial_end" in info:
            turn.info["trial_end"] = info["trial_end"]["index"]
        if step.done:
            env_status = info.get("status", "error")
            traj.status = ENV_STATUS.get(env_status, "error")
            traj.reward = float(step.reward)
            traj.task_reward = None if step.task_reward is None else float(step.task_reward)
            traj.shaping = dict(step.shaping)
            traj.reason = None if traj.status == "ok" else (info.get("reason") or env_status)
            traj.meta["env_status"] = env_status
            return
        message: Message = {"role": "user", "content": step.observation}
        turn.env_messages = [message]
        more = renderer.append(
            traj.token_ids, message, add_generation_prompt=True, enable_thinking=cfg.enable_thinking
        )
        if len(traj.token_ids) + len(more) >= cfg.max_context_tokens:
            # No room for the next reply: end here rather than store a prompt never answered.
            raise _Fatal(
                "truncated",
                f"context full: the observation of turn {turn_index} "
                f"would leave no room under {cfg.max_context_tokens} tokens",
            )
        _append_env(traj, more)
    raise _Fatal("truncated", "turn limit reached without the env ending the episode")


def _blame_replica(traj: Trajectory, affinity: Affinity) -> None:
    """A replica that went down under the episode aborts it, whichever layer met the failure
    (the agent turn, or the simulated shell that reported it as a shell error)."""
    if affinity.failures and traj.status in ("error", "timeout", "aborted"):
        down = affinity.failures[0]
        traj.status, traj.reason = "aborted", str(down)
        traj.replica_down = down.url or "no live replica"


def _append_env(traj: Trajectory, ids: list[int]) -> None:
    traj.token_ids += ids
    traj.loss_mask += [0] * len(ids)
    traj.behavior_logprobs += [None] * len(ids)
    traj.policy_version += [None] * len(ids)


async def run_replay_episode(
    real: Trajectory,
    shell_factory: ShellFactory,
    task: Task,
    renderer: ChatRenderer,
    *,
    group_id: str = "",
) -> EpisodeResult:
    """Arm (c): the recorded commands against the simulator. The trajectory's reward is the
    mean per-turn similarity of simulated to real observations (the fidelity of this replay)."""
    traj = Trajectory(
        task_id=real.task_id,
        arm="replay",
        env_backend="simulated",
        status="aborted",
        reason="not started",
        group_id=group_id,
        instruction=real.instruction,
        setup_files=dict(real.setup_files),
        prompt=list(real.prompt),
        source="rendered",
        behavior_logprobs=None,
        policy_version=None,
        tokenizer=type(renderer.tokenizer).__name__,
        task_kind=real.task_kind,
        meta={"replayed": real.task_id},
    )
    result = EpisodeResult(traj)
    sims = []
    with pinned(f"{group_id or real.task_id}-replay") as affinity:
        try:
            async with shell_factory(task) as shell:
                for i, turn in enumerate(real.turns):
                    if turn.command is None or turn.observation is None:
                        continue
                    started = time.perf_counter()
                    obs = await shell.run(turn.command, timeout_s=30.0)
                    env_s = time.perf_counter() - started
                    pair = compare_observations(
                        obs.output, turn.observation, obs.exit_code, turn.exit_code
                    )
                    sims.append(pair.similarity)
                    traj.turns.append(
                        Turn(
                            agent_text=turn.agent_text,
                            command=turn.command,
                            observation=turn.observation,
                            exit_code=turn.exit_code,
                            env_messages=list(turn.env_messages),
                            sim_observation=obs.output,
                            sim_exit_code=obs.exit_code,
                            timings={"env_s": env_s},
                            flags=[k for k in SHELL_FLAGS if obs.info.get(k)],
                            info={
                                "similarity": pair.similarity,
                                "exact_masked": pair.exact_masked,
                                "prompt_tokens": obs.info.get("prompt_tokens"),
                                "completion_tokens": obs.info.get("completion_tokens"),
                                # workspace mode: the files the simulator said changed
                                **(
                                    {"sim_changes": obs.info["changes"]}
                                    if "changes" in obs.info
                                    else {}
                                ),
                            },
                        )
                    )
                    result.timings.append(TurnTiming(i, 0.0, env_s, 0))
            traj.status, traj.reason = "ok", None
            traj.reward = sum(sims) / len(sims) if sims else 0.0
            render_token_view(traj, renderer)
        except asyncio.CancelledError:
            traj.status, traj.reason, traj.turns = (
                "aborted",
                "cancelled (rollout shutting down)",
                [],
            )
        except Exception as e:  # noqa: BLE001 - one failed replay must not end the run
            traj.status, traj.reason = "error", f"{type(e).__name__}: {e}"
            traj.turns, traj.token_ids, traj.loss_mask = [], [], []
    _blame_replica(traj, affinity)
    return result
