"""Rollout settings (no JAX): arms, groups, limits, concurrency and the staleness bound."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rl import validate

ARMS = ("real", "replay", "closed_loop", "mixed", "gated")
GATE_UNITS = ("kind", "family")
FAILED_SIBLING_POLICIES = ("mask_group", "drop_episode")


@dataclass(frozen=True)
class GateConfig:
    """`arm: gated`: which episodes the simulator may take, from its live fidelity
    (`rl.orchestrator.gate`)."""

    unit: str = "kind"
    """What is routed as one: `kind` (a task's operation, e.g. a textops `count`, else its
    family) or `family` (`textops`, `swe`, ...)."""
    threshold: float = 0.9
    """A unit's groups go to the simulator while the lower confidence bound of its fidelity
    (masked exact match of shadow-replayed real observations) is at least this."""
    confidence: float = 0.9
    """One-sided level of that bound (Wilson score interval on the decayed counts)."""
    real_min: float = 0.1
    """Share of each unit's groups that still go to the real shell while its gate is open
    (counted from when it opened), so its fidelity keeps being measured."""
    half_life_steps: float = 8.0
    """Age (in policy versions) at which a shadow measurement counts half: the agent's
    commands drift as it learns, so old measurements say less about the next episode."""
    shadow_concurrency: int = 8
    """Shadow replays against the simulator at once (off the RL critical path)."""
    remeasure: int = 16
    """Real episodes per unit kept to replay against each new simulator version, whose
    fidelity starts from those measurements alone."""
    cotrain_every: int = 0
    """Co-training: every this many RL steps the simulator takes `cotrain_steps` SFT steps on
    the run's real episodes (mixed with its original data) and is published as a new version
    to its servers; 0: the simulator stays as it is."""
    cotrain_steps: int = 20
    """SFT steps per co-training round."""
    cotrain_replay: float = 0.5
    """Share of each round's trajectories drawn from the simulator's original training data
    (`train_sim.trajectories`), against forgetting; the rest are the run's real episodes."""
    cotrain_lr: float = 1.0e-4
    """Learning rate of the co-training rounds (a constant one: continual SFT)."""

    def __post_init__(self) -> None:
        validate.one_of(self, "unit", GATE_UNITS)
        validate.fraction(self, "threshold", "real_min", "cotrain_replay")
        validate.number(self, "confidence", low=0.5, high=1, high_open=True)
        validate.number(self, "half_life_steps", "cotrain_lr", low=0, low_open=True)
        validate.integer(self, "shadow_concurrency", low=1)
        validate.integer(self, "remeasure", "cotrain_every", low=0)
        validate.integer(self, "cotrain_steps", low=1)


@dataclass(frozen=True)
class OrchestratorConfig:
    """How episodes are run."""

    arm: str = "real"
    """`real` (agent + real shell), `closed_loop` (agent + simulator), `replay` (arm c: recorded
    commands, simulated observations), `mixed` (a fraction of episodes real, the rest
    closed loop), `gated` (each group real or closed loop, by its unit's live simulator
    fidelity: `gate`)."""
    group_size: int = 1
    """Episodes per task (group-relative advantages)."""
    failed_sibling: str = "mask_group"
    """When an episode of a group ends in error/aborted/timeout: `mask_group` excludes the whole
    group (`exclusion.kind` `masked_group`: the trainer skips it, advantages need every
    sibling); `drop_episode` excludes only that episode (`dropped`). Nothing is ever deleted:
    excluded trajectories are still written."""
    mixed_real_fraction: float = 0.25
    """`mixed` arm: share of groups run in the real shell."""
    gate: GateConfig = field(default_factory=GateConfig)
    """`gated` arm: the fidelity gate and the simulator's co-training."""
    max_concurrent_episodes: int = 64
    """Episodes in flight at once."""
    max_concurrent_simulated: int = 256
    """Episodes using the simulator at once (its capacity)."""
    max_concurrent_real: int = 64
    """Episodes using real shells at once (local processes or E2B sandboxes)."""
    episode_timeout_s: float = 600.0
    """Wall-clock guard per episode; past it the episode ends `timeout`."""
    request_timeout_s: float = 120.0
    """Per agent request (the client retries connection errors, 5xx and 429)."""
    max_tokens_per_turn: int = 256
    """Cap on one agent reply; the context budget may lower it."""
    max_context_tokens: int = 4096
    """Episode context (prompt + all turns); the episode ends `truncated` when it is full."""
    temperature: float = 1.0
    """Agent sampling temperature (keep 1 with top_p 1 for unbiased importance ratios)."""
    top_p: float = 1.0
    enable_thinking: bool = False
    """Render the agent's generation prompt with thinking enabled."""
    seed: int | None = 0
    """Base sampling seed (per episode and turn); None: the server's randomness."""
    batch_size: int = 32
    """Episodes the trainer consumes per step (the admission controller's unit)."""
    max_staleness: int | None = None
    """S: an episode may start only while at most S trainer versions old; 0 is synchronous;
    None: no bound (rollout-only jobs)."""
    sessions: bool = False
    """Agent turns through a persistent KV session per episode (`simloop serve`'s
    `/v1/sessions`: each turn sends only the tokens appended since the last, the server
    keeps the KV), closed when the episode ends, also on abort. A server without sessions
    (vLLM: prefix caching only) gets stateless completions instead."""
    session_compaction: dict[str, Any] = field(default_factory=dict)
    """How the server thins each agent session's KV (`serving.compaction.SessionCompaction`):
    `{"mode": none | markovian | turn | budget, "n_protect_turns", "keep_ratio",
    "kv_budget"}`; {} is none. Episodes record what each token saw (`kv_epochs`), so the
    trainer replays it exactly. Needs `sessions: true`."""

    @property
    def compacting(self) -> bool:
        """Whether the server thins the agent sessions' KV (their episodes may outgrow a slot)."""
        return self.sessions and self.session_compaction.get("mode", "none") != "none"

    def __post_init__(self) -> None:
        validate.one_of(self, "arm", ARMS)
        if self.session_compaction:
            from serving.client import SessionCompaction

            try:
                mode = SessionCompaction.from_json(self.session_compaction).mode
            except (TypeError, ValueError) as e:
                raise validate.invalid(self, "session_compaction", str(e)) from None
            validate.require(
                mode == "none" or self.sessions,
                self,
                "session_compaction",
                "only with sessions: true (compaction acts on a session's KV)",
            )
        validate.one_of(self, "failed_sibling", FAILED_SIBLING_POLICIES)
        validate.positive_int(
            self,
            "group_size",
            "max_concurrent_episodes",
            "max_concurrent_simulated",
            "max_concurrent_real",
            "max_tokens_per_turn",
            "max_context_tokens",
            "batch_size",
        )
        validate.number(self, "episode_timeout_s", "request_timeout_s", low=0, low_open=True)
        validate.fraction(self, "mixed_real_fraction")
        validate.number(self, "temperature", low=0, nan_ok=True)
        validate.number(self, "top_p", low=0, high=1, low_open=True)
        validate.integer(
            self, "max_staleness", low=0, optional=True, allowed="null or an integer >= 0"
        )
        validate.require(
            self.max_tokens_per_turn < self.max_context_tokens,
            self,
            "max_tokens_per_turn",
            f"less than max_context_tokens ({self.max_context_tokens})",
        )
