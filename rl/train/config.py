"""Trainer settings (no JAX): optimizer, losses, checkpoints, and the two training jobs.

`TrainSimConfig` is `simloop train-sim` (simulator SFT); `TrainAgentConfig` is
`simloop train-agent` (optional SFT warm start, then RL on orchestrator episodes). Both sit in
`SimloopConfig` as `train_sim` / `train_agent`; the mesh of each trainer is its role's
`mesh` (`agent.mesh`, `simulator.mesh`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rl import validate
from rl.data.datasets import DatasetConfig
from rl.data.tokenizer import TokenizerConfig
from rl.model.config import MeshConfig, ModelConfig, tiny

ADVANTAGES = ("grpo", "drgrpo")
AGGREGATIONS = ("token_mean", "seq_mean", "rollout_mean")
LOSSES = ("sft", "policy")


@dataclass(frozen=True)
class RoleConfig:
    """One model role (the agent or the simulator): architecture, weights, tokenizer, mesh."""

    model: ModelConfig = field(default_factory=tiny)
    """Architecture; `preset: NAME` in YAML starts from a preset."""
    hf_path: str | None = None
    """Local HF directory to load weights (and the architecture) from; None: random init."""
    weights: str | None = None
    """Serving-format weights to start from (`<dir>/params` + `model_config.json`, what
    trainers export, e.g. `runs/sim/weights/final`); wins over `hf_path`. A relative path in a
    config file is relative to that file's folder; on the command line, to the working
    directory."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """`byte` for tiny models, `hf` with a local path otherwise."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Sub-mesh shape of this role's trainer (data x fsdp x tensor devices)."""
    server_url: str | None = None
    """Inference server of this role (simloop serve or vllm-tpu); None: jobs that need one
    start a local `simloop serve` for it."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay and global-norm clipping."""

    lr: float = 1e-3
    """Peak learning rate (reached after `warmup_steps`)."""
    warmup_steps: int = 10
    """Linear warmup from 0 to `lr`."""
    decay_steps: int | None = None
    """Cosine decay length after warmup; None: the job's remaining steps."""
    min_lr_ratio: float = 0.1
    """The cosine ends at `lr * min_lr_ratio`."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW), applied to matrices only (not norms)."""
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    """Global gradient-norm clip; None disables it."""
    grad_accum: int = 1
    """Micro-batches per optimizer step: the batch is split along B and the micro-batch
    gradients combined exactly as one big batch would weigh them."""

    def __post_init__(self) -> None:
        validate.number(self, "lr", "eps", low=0.0, low_open=True, nan_ok=True)
        validate.integer(self, "warmup_steps", low=0)
        validate.integer(self, "decay_steps", low=1, optional=True, allowed="an integer >= 1")
        validate.fraction(self, "min_lr_ratio")
        validate.number(self, "weight_decay", low=0.0, nan_ok=True)
        validate.number(self, "b1", "b2", low=0, high=1, high_open=True)
        validate.number(self, "clip_norm", low=0.0, low_open=True, optional=True, nan_ok=True)
        validate.integer(self, "grad_accum", low=1)


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy-gradient loss (docs/architecture.md §8: sampler/trainer mismatch, stragglers)."""

    advantage: str = "grpo"
    """`grpo`: reward minus the group mean (divided by the group std when `std_norm`);
    `drgrpo`: reward minus the group mean, never std-normalised, and the loss summed over
    tokens and divided by a constant (rows x seq_len) instead of the token count."""
    std_norm: bool = True
    """GRPO only: divide advantages by the group's reward std (+1e-6)."""
    eps_low: float = 0.2
    """PPO clip below: the ratio is clipped at 1 - eps_low."""
    eps_high: float = 0.28
    """PPO clip above (clip-higher): 1 + eps_high."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling: the trainer/sampler ratio is capped at C; None disables
    the correction (ratio 1)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the frozen reference (the weights RL started from); 0
    skips the reference forward."""
    truncated_reward: float | None = 0.0
    """Reward of episodes that ended `truncated` without one (context full, turn limit): 0
    counts them as failures; None leaves them out of the batch (overlong filtering)."""
    aggregation: str = "token_mean"
    """`token_mean`: mean over every generated token of the batch; `seq_mean`: mean per
    episode, then over episodes; `rollout_mean`: mean per rollout (the trajectories sharing a
    `rollout_id`: the segments of one harness run through `simloop middleware`, pooled), then
    over rollouts, so a rollout split into many segments weighs as much as one that was not.
    (`drgrpo` overrides all three, see `advantage`.)"""

    def __post_init__(self) -> None:
        validate.one_of(self, "advantage", ADVANTAGES)
        validate.one_of(self, "aggregation", AGGREGATIONS)
        validate.number(self, "eps_low", low=0, high=1, high_open=True)
        validate.number(self, "eps_high", "kl_coef", low=0.0, nan_ok=True)
        validate.number(self, "tis_cap", low=1.0, optional=True, nan_ok=True)


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints of a trainer (params, optimizer, step, RNG, data position)."""

    every_steps: int = 50
    """Save every N optimizer steps (and always after the last step)."""
    keep: int = 3
    """Keep the last k checkpoints."""
    async_save: bool = True
    """Write in a background thread while training goes on."""
    export_dtype: str = "float32"
    """Dtype of exported serving weights (`bfloat16` on TPU)."""
    export_hf: bool = False
    """Also write HF safetensors (for vLLM) next to the serving weights."""

    def __post_init__(self) -> None:
        validate.integer(self, "every_steps", "keep", low=1)
        validate.one_of(
            self,
            "export_dtype",
            ("float32", "bfloat16", "float16"),
            allowed="float32, bfloat16 or float16",
        )


@dataclass(frozen=True)
class TrainSimConfig:
    """`simloop train-sim`: SFT of the simulator on real trajectories."""

    trajectories: list[str] = field(default_factory=list)
    """JSONL files or folders of real trajectories (`simloop collect` / `import` output)."""
    heldout_fraction: float = 0.1
    """Share of trajectories (by task id hash) held out of training for `eval-sim`."""
    kind_weights: dict[str, int] | None = None
    """How many times each training trajectory of a task kind (`task_kind`, e.g. a
    textops operation) is in the data, e.g. `{count: 2}`: more rows of the kind the simulator
    finds hardest. Kinds not named (and trajectories without a kind) count once; None: all
    once. The held-out trajectories are never repeated."""
    steps: int = 200
    """Optimizer steps."""
    data: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_epochs=None))
    """Packing and order; `batch_size` x `seq_len` tokens per step."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log_every: int = 10
    """Pull metrics from the device (and print / write them) every N steps."""
    eval_every: int = 0
    """Every N steps (a multiple of `log_every`; 0: never), the held-out trajectories' greedy
    exact match per task kind (one teacher-forced forward; `sim_sft_eval` records in
    `metrics.jsonl`): the simulator's fidelity learning curve by operation."""

    def __post_init__(self) -> None:
        validate.integer(self, "steps", "log_every", low=1)
        validate.integer(self, "eval_every", low=0)
        validate.require(
            self.eval_every % self.log_every == 0,
            self,
            "eval_every",
            f"a multiple of log_every ({self.log_every})",
        )
        validate.number(self, "heldout_fraction", low=0, high=1, high_open=True)
        w = self.kind_weights
        validate.require(
            w is None
            or (
                isinstance(w, dict)
                and all(isinstance(k, str) and k for k in w)
                and all(validate.is_int(v) and v >= 1 for v in w.values())
            ),
            self,
            "kind_weights",
            "a mapping from task kinds to integers >= 1",
        )


@dataclass(frozen=True)
class WarmStartConfig:
    """Agent SFT before RL, on demonstration trajectories (skipped when `steps` is 0)."""

    trajectories: list[str] = field(default_factory=list)
    """JSONL files or folders of demonstrations; empty: scripted textops demonstrations are
    collected in the real shell (`num_demos` of them)."""
    num_demos: int = 64
    noise: float = 0.0
    """Scripted demonstrations only: the share of imperfect ones (a plausible mistake of
    `noise_kinds`), kept in the SFT data like any demonstration: the warm-started agent then
    makes such mistakes at about that rate, which RL has to unlearn."""
    noise_kinds: list[str] = field(default_factory=lambda: ["other_op"])
    """`other_op` (another operation's command), `typo`, `wrong_answer`."""
    steps: int = 0
    data: DatasetConfig = field(default_factory=lambda: DatasetConfig(num_epochs=None))
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self) -> None:
        validate.integer(self, "steps", low=0)
        validate.integer(self, "num_demos", low=1)
        validate.fraction(self, "noise")


@dataclass(frozen=True)
class AgentEvalConfig:
    """The policy's success on held-out tasks, before and after RL (`simloop train-agent`)."""

    tasks: int = 48
    """Held-out textops tasks, generated after the `env.textops.num_tasks` training tasks
    (so never trained on); 0 skips evaluation."""
    samples: int = 4
    """Episodes per task (sampled at the rollout temperature, fixed seed)."""
    arms: list[str] = field(default_factory=lambda: ["real"])
    """Where to evaluate: `real` (the real shell) and/or `closed_loop` (the simulator)."""
    before: bool = True
    """Also evaluate the policy RL starts from; false when another run already measured that
    policy (the demo's real-shell RL arm starts from the simulator arm's warm start)."""

    def __post_init__(self) -> None:
        validate.integer(self, "tasks", low=0)
        validate.integer(self, "samples", low=1)
        validate.boolean(self, "before")
        allowed = ("real", "closed_loop")
        validate.require(
            self.arms and all(a in allowed for a in self.arms),
            self,
            "arms",
            f"a non-empty list drawn from {list(allowed)}",
        )


@dataclass(frozen=True)
class TrainAgentConfig:
    """`simloop train-agent`: warm start, then RL on episodes from the orchestrator.

    Episodes per step and the staleness bound S are `orchestrator.batch_size` and
    `orchestrator.max_staleness` (S = 0 is synchronous); the env is `orchestrator.arm`."""

    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    steps: int = 20
    """RL optimizer steps (one batch of episodes each)."""
    seq_len: int | None = None
    """Row length of RL batches; None: `orchestrator.max_context_tokens`."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-4, warmup_steps=0))
    checkpoint: CheckpointConfig = field(default_factory=lambda: CheckpointConfig(every_steps=5))
    publish_every: int = 1
    """Publish new weights to the agent server every N steps (the policy version grows by one
    per step either way)."""
    overlap_publish: bool = True
    """Export and publish version v in the background while the next batch and step run (at
    most one version in flight); the episode source hears of v only once the servers serve it.
    A straggler may then be trained `orchestrator.max_staleness` + 1 versions old (`rl_loop`'s
    docstring; 0 stays synchronous); false waits for every publish and keeps the bound exact.
    Not with `tasks: swe`, whose harness rollouts start without waiting for a version."""
    log_every: int = 1
    eval: AgentEvalConfig = field(default_factory=AgentEvalConfig)
    tasks: str = "textops"
    """`textops`: the built-in agent loop on `env.textops` tasks (orchestrator arms);
    `swe`: the built-in SWE suite (`harness.tasks`), each episode an unmodified harness
    (`harness`) through `simloop middleware`, graded in a clean sandbox; `file:PATH`: the same
    on the SWE-bench-shaped instances of a JSONL file (`envs.swe_file`), graded as SWE-bench
    grades them."""

    @property
    def swe(self) -> bool:
        """Harness rollouts on SWE tasks (`swe` or `file:PATH`)."""
        return self.tasks == "swe" or self.tasks.startswith("file:")

    @property
    def task_file(self) -> str | None:
        return self.tasks.removeprefix("file:") if self.tasks.startswith("file:") else None

    def __post_init__(self) -> None:
        validate.require(
            isinstance(self.tasks, str)
            and (self.tasks in ("textops", "swe") or len(self.tasks) > len("file:"))
            and (self.tasks in ("textops", "swe") or self.tasks.startswith("file:")),
            self,
            "tasks",
            "'textops', 'swe' or 'file:PATH' (a JSONL file of SWE-bench-shaped instances)",
        )
        validate.integer(self, "steps", low=0)
        validate.integer(self, "publish_every", "log_every", low=1)
        validate.boolean(self, "overlap_publish")
        validate.integer(self, "seq_len", low=2, optional=True, allowed="an integer >= 2")
