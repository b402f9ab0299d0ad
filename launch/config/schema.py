"""The top-level `SimloopConfig` every subcommand reads: one frozen dataclass per component.

Imports no JAX. Sections grow as components land (server, envs, orchestrator, trainers); a
YAML file only names what it changes from these defaults.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from envs.config import (
    TRANSFORM_OPS,
    FileopsConfig,
    GrammarConfig,
    ShellConfig,
    TerminalConfig,
    TextopsConfig,
)
from launch.config.deploy import ChipsConfig, GkeConfig, TpuVmConfig
from rl import validate
from rl.data.datasets import DatasetConfig
from rl.model.config import ModelConfig, ShardingConfig
from rl.orchestrator.config import OrchestratorConfig
from rl.orchestrator.harness import HarnessConfig
from rl.train.config import (
    CheckpointConfig,
    OptimConfig,
    RoleConfig,
    TrainAgentConfig,
    TrainSimConfig,
)
from serving.config import EngineConfig, ServerConfig
from serving.middleware.config import MiddlewareConfig
from serving.token_sessions import TOKEN_LEVEL_MODES
from serving.vllm.config import VllmConfig


@dataclass(frozen=True)
class RunConfig:
    """Identity and seeding of one run."""

    name: str = "simloop"
    """Shown in logs and reports; tags cloud resources."""
    seed: int = 0
    """Root PRNG seed; every component derives its keys from it."""
    wandb: bool = False
    """Also log the scalars of `metrics.jsonl` to Weights & Biases (they always go to
    `<run>/tensorboard/`). Needs `pip install 'simloop[wandb]'`; without it the run warns once
    and carries on."""
    wandb_project: str = "simloop"
    """The W&B project. Runs are grouped by `name` and named after their run directory."""
    wandb_mode: Literal["auto", "offline", "online"] = "auto"
    """`offline` writes `<run>/wandb/` for a later `wandb sync` and never needs the network;
    `auto` is `online` when WANDB_API_KEY is set, else `offline`."""
    compile_cache: bool = True
    """JAX's persistent compilation cache (`launch/compile_cache.py`): a program compiled once
    on this machine is loaded by every later process instead of compiled again. False: off."""
    compile_cache_dir: str | None = None
    """Where it lives; None: $SIMLOOP_COMPILE_CACHE_DIR, else $XDG_CACHE_HOME/simloop/xla
    (~/.cache/simloop/xla)."""
    processes: int = 1
    """JAX processes of the job on this machine (`launch/distributed.py`): with N > 1 and a
    `cpu-M` chip plan, `pretrain-sim` and `train-sim` start N processes of M/N fake devices each,
    joined into one runtime (what the hosts of a pod slice are), process 0 writing the run. On
    a pod the processes come from the hosts instead (SIMLOOP_COORDINATOR, _NUM_PROCESSES,
    _PROCESS_ID)."""
    heartbeat_timeout_s: int = 100
    """How long the processes of a multi-process job wait for a silent peer before all of them
    stop (so a job whose process died ends, rather than hanging in a collective)."""

    def __post_init__(self) -> None:
        validate.text(self, "name")
        validate.integer(self, "seed", low=0)
        validate.boolean(self, "wandb")
        validate.text(self, "wandb_project")
        validate.integer(self, "processes", low=1, high=64, allowed="1..64")
        validate.integer(self, "heartbeat_timeout_s", low=2, allowed="an integer >= 2 (seconds)")
        validate.boolean(self, "compile_cache")
        validate.text(
            self,
            "compile_cache_dir",
            optional=True,
            allowed="a directory path, or null for the default",
        )
        validate.one_of(
            self, "wandb_mode", ("auto", "offline", "online"), allowed="auto, offline or online"
        )


MAX_SLOTS = 1 << 16
MAX_SEQ_LEN = 1 << 20


BACKENDS = ("jax", "vllm")
MODEL_ROLES = ("agent", "simulator")


@dataclass(frozen=True)
class ServeConfig:
    """The inference servers jobs start (and `simloop serve`: which role's model, and how).

    The backend is a serving setting, not a model one: it lives here, next to the engine it
    replaces, with a per-role override, rather than in `RoleConfig` (the trainers' view of a
    model, which `rl/train` owns and which never imports serving)."""

    backend: Literal["jax", "vllm"] = "jax"
    """What serves each role a job starts a server for: `jax` (simloop's own `simloop serve`,
    the embedded default) or `vllm` (`vllm.command`, normally `vllm serve`, with simloop's
    Orbax worker extension: the TPU production path)."""
    backends: dict[str, str] = field(default_factory=dict)
    """Per-role override of `backend`, e.g. `{simulator: jax}`."""
    role: Literal["agent", "simulator"] = "agent"
    """`simloop serve`: the role whose model (and tokenizer) the server loads."""
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    restart_attempts: int = 3
    """A job's own server replica that dies is restarted this many times before it is retired
    (the other replicas keep serving); 0 never restarts."""
    restart_backoff_s: float = 2.0
    """Wait after a failed restart attempt, doubled after each."""

    def backend_of(self, role: str) -> str:
        """The backend serving model role `role` (`agent` or `simulator`)."""
        return self.backends.get(role, self.backend)

    def __post_init__(self) -> None:
        validate.one_of(self, "backend", BACKENDS)
        validate.require(
            isinstance(self.backends, dict)
            and all(k in MODEL_ROLES and v in BACKENDS for k, v in self.backends.items()),
            self,
            "backends",
            f"a mapping from {list(MODEL_ROLES)} to {list(BACKENDS)}",
        )
        validate.integer(self, "restart_attempts", low=0, high=100)
        validate.number(self, "restart_backoff_s", low=0, high=3600, allowed="seconds in [0, 3600]")
        validate.integer(self.engine, "num_slots", low=1, high=MAX_SLOTS)
        validate.integer(self.engine, "max_seq_len", low=1, high=MAX_SEQ_LEN)


TASK_FAMILIES = ("textops", "fileops")


@dataclass(frozen=True)
class EnvConfig:
    """Where episodes run and what they ask."""

    shell: ShellConfig = field(default_factory=ShellConfig)
    """Backend (`local`, `e2b`, `simulated`) and its settings."""
    terminal: TerminalConfig = field(default_factory=TerminalConfig)
    """Action parsing, observation format and episode limits."""
    family: str = "textops"
    """The seeded task family that `collect`, `train-agent` and `eval-agent` draw from:
    `textops` (one transformation of one word, 1-3 turns) or `fileops` (workspace tasks of
    3-8 commands whose later ones read what earlier ones wrote: give episodes the turns,
    e.g. `--env.terminal.max_turns 8`)."""
    textops: TextopsConfig = field(default_factory=TextopsConfig)
    """The `textops` family."""
    fileops: FileopsConfig = field(default_factory=FileopsConfig)
    """The `fileops` family."""

    def __post_init__(self) -> None:
        validate.one_of(self, "family", TASK_FAMILIES)


def _noise_kinds() -> tuple[str, ...]:
    from rl.orchestrator.scripted import NOISE_KINDS

    return NOISE_KINDS


@dataclass(frozen=True)
class PretrainSimConfig:
    """`simloop pretrain-sim`: the simulator learns to compute terminal output from its context
    on real-bash transcripts of a utility grammar (`envs.shellgrammar`), before any agent's
    trajectories. Its weights seed `train-sim` through `simulator.weights`."""

    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    cases: int = 12_000
    """Workspaces run in real bash; each gives `grammar.commands_per_case` examples."""
    eval_cases: int = 200
    """Held-out workspaces (another seed) scored every `eval_every` steps."""
    concurrency: int = 8
    """Workspaces run at once while collecting."""
    steps: int = 4_000
    """Optimizer steps in all (the short stage's included)."""
    short_steps: int = 1_000
    """Curriculum: the first steps train only on rows of at most `short_data.seq_len` tokens
    (commands that carry their word, a few dozen bytes before the output), where copying is
    learned soonest; then every row."""
    short_data: DatasetConfig = field(
        default_factory=lambda: DatasetConfig(seq_len=128, batch_size=64, num_epochs=None)
    )
    data: DatasetConfig = field(
        default_factory=lambda: DatasetConfig(seq_len=384, batch_size=16, num_epochs=None)
    )
    drill: GrammarConfig = field(default_factory=lambda: GrammarConfig(seed=1))
    """A second grammar whose rows are trained on alongside the main one's, in every batch: a
    skill's own data kept in the mix while the rest of the grammar trains, e.g. count commands
    alone (`op_weights: {count: 1, reverse: 0, upper: 0, sort: 0}`, `typo_prob: 0`) so a
    counting circuit formed in an earlier count-only run is not unlearned."""
    drill_cases: int = 0
    """Workspaces of `drill` run in real bash (0: no drill); their examples join the training
    rows (the held-out evaluation stays the main grammar's)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=3e-3, warmup_steps=100))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval_every: int = 250
    log_every: int = 10

    def __post_init__(self) -> None:
        validate.integer(
            self, "cases", "eval_cases", "concurrency", "steps", "eval_every", "log_every", low=1
        )
        validate.integer(self, "short_steps", "drill_cases", low=0)
        if self.drill_cases:
            validate.require(
                self.drill.seed != self.grammar.seed,
                self,
                "drill.seed",
                f"it must differ from grammar.seed ({self.grammar.seed}), or the drill repeats "
                "the grammar's workspaces, and those past `cases` are the held-out ones",
                value=self.drill.seed,
            )
        validate.require(
            self.short_steps <= self.steps, self, "short_steps", f"at most steps ({self.steps})"
        )


@dataclass(frozen=True)
class CollectConfig:
    """`simloop collect`: the scripted agent that gathers real trajectories."""

    episodes: int = 128
    """Episodes to run (tasks are taken in order, repeating)."""
    style: str = "two_step"
    """`two_step` (compute, then submit what the shell printed), `marker` (one turn) or
    `explore` (`commands` commands on the word, most of them other operations, then submit:
    long sessions; `env.terminal.max_turns` must exceed `commands`)."""
    commands: int = 8
    """`explore`: commands per episode before the submission."""
    noise: float = 0.2
    """Probability that a turn's reply carries a mistake (another operation's command, a typo,
    a wrong answer), so the data also shows failing commands."""
    noise_kinds: list[str] = field(default_factory=lambda: list(_noise_kinds()))
    """Which mistakes. `other_op` matters most for a simulator: the same file under every
    command shows it that the output follows the command, not the task."""
    fileops_mistakes: list[str] | None = None
    """`fileops` episodes: which of the scripted solver's mistakes to draw from
    (`envs.fileops.MISTAKES`, recovered from, and `SLIPS`, not); None: every recovered
    mistake, and the `other_op` slip when `noise_kinds` holds `other_op`. E.g. `[garble]`
    collects the broken commands a small agent writes, so a simulator learns bash's errors."""
    fileops_checks: float = 0.0
    """`fileops` episodes: probability that the solver reads back a file after a step that
    writes one (`cat`, `tail -n 1`, `wc -l <`, ...: `envs.fileops.CHECK_READS`; two per episode
    at most), the file just written or an older one. More reads of episode-written files, at
    several state distances, for simulator training data."""
    task_seed: int | None = None
    """Seed of the tasks collected on (of `env.family`); None: the family's own seed (the
    agent's training tasks). Another seed collects on tasks the agent never trains on."""
    num_tasks: int | None = None
    """How many tasks to collect on; None: the family's `num_tasks`."""

    def __post_init__(self) -> None:
        from envs.textops import SOLVER_STYLES

        NOISE_KINDS = _noise_kinds()

        validate.integer(self, "episodes", low=1)
        validate.one_of(self, "style", SOLVER_STYLES)
        validate.fraction(self, "noise")
        validate.require(
            self.noise_kinds and all(k in NOISE_KINDS for k in self.noise_kinds),
            self,
            "noise_kinds",
            f"a non-empty list drawn from {list(NOISE_KINDS)}",
        )
        if self.fileops_mistakes is not None:
            from envs.fileops import MISTAKES, SLIPS

            validate.require(
                bool(self.fileops_mistakes)
                and all(m in MISTAKES + SLIPS for m in self.fileops_mistakes),
                self,
                "fileops_mistakes",
                f"null or a non-empty list drawn from {list(MISTAKES + SLIPS)}",
            )
        validate.fraction(self, "fileops_checks")
        validate.integer(self, "commands", low=1)
        validate.integer(self, "task_seed", low=0, optional=True)
        validate.integer(self, "num_tasks", low=1, optional=True)


@dataclass(frozen=True)
class EvalSimConfig:
    """`simloop eval-sim` (arm c): the recorded commands of real trajectories replayed against
    the simulator, its observations scored against the real ones."""

    trajectories: list[str] = field(default_factory=list)
    """Real trajectories (JSONL files or folders from `simloop collect` / `simloop import`)."""
    heldout_tasks: str | None = None
    """A JSON list of task ids to keep (`simloop train-sim` writes `heldout_tasks.json`), so
    the simulator is scored on tasks it never trained on; None: every trajectory."""
    max_trajectories: int | None = None
    """Replay at most this many (the first ones, in file order); None: all."""
    context_edges: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    """Bucket edges (prompt tokens) of the fidelity-by-context-length table."""
    depth_edges: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    """Bucket edges (turns before the command) of the fidelity-by-depth table; `[1, 2, ...,
    8]` gives one row per depth up to 8 (the stateful experiment's)."""

    def __post_init__(self) -> None:
        validate.integer(self, "max_trajectories", low=1, optional=True)
        for name in ("context_edges", "depth_edges"):
            edges = getattr(self, name)
            validate.require(
                isinstance(edges, list)
                and all(validate.is_int(e) and e >= 1 for e in edges)
                and list(edges) == sorted(set(edges)),
                self,
                name,
                "increasing positive integers",
            )


@dataclass(frozen=True)
class DemoConfig:
    """`simloop demo`: collect -> train-sim -> eval-sim -> train-agent -> report, each stage in
    its own subdirectory of the run directory."""

    rl_arm: str = "closed_loop"
    """Where the agent's RL episodes run: `closed_loop` (the simulator: the point of the
    demo), `real` or `mixed`."""
    eval_arms: list[str] = field(default_factory=lambda: ["real", "closed_loop"])
    """Where the agent is evaluated before and after RL."""
    real_rl: bool = True
    """The deciding experiment's control arm: RL in the real shell from the same warm start
    with the same number of episodes, evaluated in the real shell like the simulator arm."""
    sim_max_tokens_from_data: bool = True
    """Set the simulator's token cap (`env.shell.simulated.max_tokens`) from the collected
    real observations (`envs.fidelity.suggest_max_tokens`), so a runaway costs little."""
    sim_max_tokens_quantile: float = 0.99
    """Which of the collected observation lengths that cap covers (with 25% slack): 0.99
    lets the longest 1% be cut; 1.0 lets the simulator write every observation it was shown
    whole (the context must hold it beside the prompt: `max_prompt_tokens`)."""
    trials: int = 0
    """With K >= 2, an optional last stage (`trials/`): the agent on textops tasks whose
    instruction hides the operation, K trials per episode (a failed attempt's feedback says
    what the checker wanted), warm-started on adapting demonstrations and trained with RL in
    the real shell; summary.json's `trials` holds success by trial and the adaptation delta
    before and after RL. 0: no such stage."""
    trials_overrides: list[str] = field(
        default_factory=lambda: [
            "--env.textops.hidden_op_prob", "1.0",
            "--env.terminal.turns_per_trial", "1",
            "--env.terminal.trial_feedback_template", "Wrong.{verdict}",
            "--orchestrator.max_context_tokens", "768",
            "--serve.engine.max_seq_len", "768",
            "--train_agent.warm_start.data.seq_len", "768",
        ]
    )  # fmt: skip
    """What the `trials` stage sets besides `env.terminal.trials` (the byte-level agent needs
    the longer context for two attempts and a short feedback)."""

    stateful_overrides: list[str] = field(
        default_factory=lambda: [
            "--env.family", "fileops",
            "--env.fileops.kinds", "[chain]",
            "--env.terminal.max_turns", "6",
            "--simulator.weights", "pretrained/sim-fileops",
            "--env.shell.simulated.workspace", "true",
            "--env.shell.simulated.workspace_named_last", "true",
            "--env.shell.simulated.workspace_named_absent", "true",
            "--env.shell.simulated.max_prompt_tokens", "640",
            "--demo.sim_max_tokens_from_data", "false",
            "--orchestrator.max_context_tokens", "1536",
            "--serve.engine.max_seq_len", "1536",
            "--collect.episodes", "480",
            "--collect.num_tasks", "480",
            "--train_sim.steps", "200",
            "--train_sim.eval_every", "0",
            "--train_sim.data.exit_code_weight", "10",
            "--train_sim.optim.lr", "1e-4",
            "--env.fileops.max_k", "2",
            "--env.fileops.num_tasks", "2048",
            "--train_agent.warm_start.num_demos", "1536",
            "--train_agent.warm_start.steps", "600",
            "--train_agent.warm_start.data.seq_len", "1024",
            "--train_agent.warm_start.data.batch_size", "4",
            "--eval_sim.depth_edges", "[1, 2, 3, 4, 5, 6, 7, 8]",
            "--demo.wide_heldout_episodes", "240",
        ]
    )  # fmt: skip
    """`simloop demo --experiment stateful`: what turns the demo's config into the deciding
    experiment on `fileops` `chain` tasks (transform `input.txt` into `a.txt`, `a.txt` into
    `b.txt`, submit a property of `b.txt`: every answer depends on two files the episode
    wrote): the workspace-mode simulator pretrained for the family, the turns and contexts
    multi-turn episodes need, a cap on the simulator's reply that holds its changes (not one
    derived from the observations alone), one fidelity row per depth, and a fine-tune that
    weights the return code's digits 10 times (`train_sim.data.exit_code_weight`: from the
    simulator before stage 10, the demo's fine-tune without it answered `sotr -r a.txt >
    b.txt` and a bare `t` with silence, return codes 0.977, and with it 0.989; from stage 10,
    with it, 1.000; 2026-12-07), at half the config's rate (1e-4: at 2e-4 the 200 steps on
    `chain` alone cost the other kinds, return codes 0.987 on the wider collection, against
    0.991; the same on `chain`), served as it was trained from stage 11: the files each
    command names listed last in its prompt (`workspace_named_last`) and, from stage 14, the
    file names it gives that are not there on a line of their own (`workspace_named_absent`:
    stage 13 answered a relay step run before its input existed with silence, return codes
    0.986 on the wider collection; stage 14 0.996), with a prompt budget
    of 640 tokens (a deep `relay` workspace, seven files, can pass 512; a prompt within 512
    renders the same either way); and arm (c) on a wider held-out collection too
    (`wide_heldout_episodes`). The tiny byte-level
    agent gets `chain` only, with every `head`/`tail` keeping 2 lines (`max_k`): the other
    kinds make it copy words and names, and the line counts numbers, that it cannot learn to
    copy (it wrote the instruction's count a third of the time, and RL never changed that).
    Its warm start sees 1,536 demonstrations (one per training task: at 384 over 1,200 steps
    it learnt their mistakes by heart) for 600 steps: 0.693 held-out success, its mistakes
    choices RL can fix (a wrong transformation or property; 0.885 after 1,200 steps, too
    little left to gain; at 300 steps it had not learnt to read the instruction). RL in the
    real shell from there: 0.865 (2026-12-06). They come after the config file and before
    `--quick`'s and the user's overrides."""
    wide_heldout_episodes: int = 0
    """With N > 0, two stages after arm (c): a second held-out collection of N scripted
    episodes (`collect_wide`, made by `wide_heldout_overrides` on top of the experiment's
    config) and arm (c) on all of it (`eval_sim_wide`), so the fidelity at depths and state
    distances the experiment's own tasks never reach is measured on the simulator the demo
    trained; summary.json's `stateful.wide` holds its acceptance. The stateful experiment
    sets 240; 0: none."""
    wide_heldout_overrides: list[str] = field(
        default_factory=lambda: [
            "--env.fileops.kinds", "[chain, append, move, fanout, relay, relay, relay, relay]",
            "--env.fileops.max_k", "null",
            "--env.fileops.num_tasks", "64",
            "--env.terminal.max_turns", "8",
            "--collect.task_seed", "11",
            "--collect.noise", "0.5",
            "--orchestrator.max_context_tokens", "4096",
            "--orchestrator.max_tokens_per_turn", "200",
        ]
    )  # fmt: skip
    """What makes the wider held-out collection (`wide_heldout_episodes`): every fileops
    kind with the family's defaults, half of the episodes the deep `relay` (six or seven
    commands, eight with a mistake: turns 6-8, depths 5-7, which no other kind reaches), up
    to 8 turns, the scripted agent's mistakes in half the episodes, task seed 11 (no
    collection a shipped simulator trained on uses it)."""
    gating_sim_steps: int = 400
    """`simloop demo --experiment gating`: train-sim steps of its deliberately weak simulator
    (0: the pretrained simulator as it is, never fine-tuned on the agent's dialect)."""
    gating_wrong_ops: list[str] = field(default_factory=lambda: ["upper"])
    """The operations that simulator is wrong about: it is fine-tuned on the collection as a
    shell where their pipeline stages print the input unchanged would have answered
    (`envs.textops.misreport`), and is right about the rest. Drawn from reverse, upper, sort;
    [] (or 0 steps): no operation misreported."""
    gating_eval_tasks: int = 192
    """Held-out tasks each arm of the gating experiment is evaluated on in the real shell
    (`train_agent.eval.samples` each); 0: `train_agent.eval.tasks`."""
    gating_overrides: list[str] = field(
        default_factory=lambda: [
            "--orchestrator.gate.threshold", "0.75",
            "--orchestrator.gate.real_min", "0.1",
            "--orchestrator.gate.cotrain_every", "2",
            "--orchestrator.gate.cotrain_steps", "20",
            "--orchestrator.gate.cotrain_replay", "0.2",
        ]
    )  # fmt: skip
    """What the experiment's gated arm sets besides `--orchestrator.arm gated`. A fifth of each
    co-training round replays the weak simulator's own data, which is wrong about
    `gating_wrong_ops`: the round's real episodes outweigh it four to one."""

    quick_overrides: list[str] = field(
        default_factory=lambda: [
            "--collect.episodes", "96",
            "--train_sim.steps", "8",
            "--train_agent.warm_start.num_demos", "16",
            "--train_agent.warm_start.steps", "6",
            "--train_agent.steps", "2",
            "--train_agent.eval.tasks", "6",
            "--train_agent.eval.samples", "2",
            "--orchestrator.batch_size", "16",
            "--eval_sim.max_trajectories", "12",
            "--demo.gating_sim_steps", "8",
            "--demo.gating_eval_tasks", "0",
        ]
    )  # fmt: skip
    """Dotted overrides `--quick` applies on top of the config (a CI-sized run, minutes)."""

    def __post_init__(self) -> None:
        arms = ("real", "closed_loop", "mixed")
        validate.one_of(self, "rl_arm", arms)
        validate.require(
            validate.is_int(self.trials) and (self.trials == 0 or self.trials >= 2),
            self,
            "trials",
            "0 (no multi-trial stage) or an integer >= 2",
        )
        validate.integer(
            self, "gating_sim_steps", "gating_eval_tasks", "wide_heldout_episodes", low=0
        )
        w_over = self.wide_heldout_overrides
        validate.require(
            isinstance(w_over, list | tuple) and all(isinstance(f, str) for f in w_over),
            self,
            "wide_heldout_overrides",
            "a list of override strings (--flag, value, ...)",
        )
        w = self.gating_wrong_ops
        validate.require(
            isinstance(w, list | tuple) and all(op in TRANSFORM_OPS for op in w),
            self,
            "gating_wrong_ops",
            f"a list drawn from {list(TRANSFORM_OPS)}",
        )
        validate.number(self, "sim_max_tokens_quantile", low=0, high=1, low_open=True)
        validate.require(
            self.eval_arms and all(a in ("real", "closed_loop") for a in self.eval_arms),
            self,
            "eval_arms",
            "a non-empty list drawn from ['real', 'closed_loop']",
        )


@dataclass(frozen=True)
class SimloopConfig:
    """Everything a `simloop` subcommand reads."""

    run: RunConfig = field(default_factory=RunConfig)
    agent: RoleConfig = field(default_factory=RoleConfig)
    """The policy: issues one shell command per turn."""
    simulator: RoleConfig = field(default_factory=RoleConfig)
    """The learned terminal: writes the observation for a command."""
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    """Logical-axis -> mesh-axis rules shared by every role."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Shells, the terminal env and task families."""
    serve: ServeConfig = field(default_factory=ServeConfig)
    """Inference server settings."""
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """Rollouts: arm, groups, limits, concurrency, staleness."""
    collect: CollectConfig = field(default_factory=CollectConfig)
    """`simloop collect`: scripted real trajectories for the simulator."""
    pretrain_sim: PretrainSimConfig = field(default_factory=PretrainSimConfig)
    """`simloop pretrain-sim`: the simulator on real bash over a utility grammar."""
    train_sim: TrainSimConfig = field(default_factory=TrainSimConfig)
    """`simloop train-sim`: simulator SFT (mesh: `simulator.mesh`)."""
    eval_sim: EvalSimConfig = field(default_factory=EvalSimConfig)
    """`simloop eval-sim`: arm (c) fidelity of the simulator on real trajectories."""
    demo: DemoConfig = field(default_factory=DemoConfig)
    """`simloop demo`: the whole pipeline (`--quick`: CI-sized)."""
    train_agent: TrainAgentConfig = field(default_factory=TrainAgentConfig)
    """`simloop train-agent`: warm start + RL (mesh: `agent.mesh`)."""
    chips: ChipsConfig = field(default_factory=ChipsConfig)
    """Which chips (TPU) or fake devices (CPU) each role gets: `simloop plan-chips`."""
    tpu_vm: TpuVmConfig = field(default_factory=TpuVmConfig)
    """`simloop tpu-vm`: the Cloud TPU VM."""
    gke: GkeConfig = field(default_factory=GkeConfig)
    """`simloop gke render`: the JobSet."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """vllm-tpu servers for the serving roles."""
    middleware: MiddlewareConfig = field(default_factory=MiddlewareConfig)
    """`simloop middleware`: Anthropic / OpenAI APIs for unmodified agent harnesses."""
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    """`simloop harness`: an unmodified agent harness on SWE tasks through the middleware."""

    def __post_init__(self) -> None:
        check_session_backends(self)


def session_settings(cfg: SimloopConfig) -> dict[str, dict[str, Any]]:
    """Per serving role: whether its episodes run on persistent KV sessions, the setting that
    turns them on, and the compaction mode asked for (`orchestrator.sessions` puts both
    roles on sessions; `env.shell.simulated.sessions` the simulator alone)."""
    o, sim = cfg.orchestrator, cfg.env.shell.simulated
    return {
        "agent": {
            "sessions": bool(o.sessions),
            "setting": "orchestrator.sessions",
            "compaction": (o.session_compaction or {}).get("mode", "none"),
            "compaction_setting": "orchestrator.session_compaction",
        },
        "simulator": {
            "sessions": bool(sim.sessions or o.sessions),
            "setting": "env.shell.simulated.sessions" if sim.sessions else "orchestrator.sessions",
            "compaction": (sim.session_compaction or {}).get("mode", "none"),
            "compaction_setting": "env.shell.simulated.session_compaction",
        },
    }


def check_session_backends(cfg: SimloopConfig) -> None:
    """ValueError when a role's episodes are asked for session compaction that its backend
    cannot do: on vLLM the client keeps the sessions (`serving.token_sessions`: the prompt and
    the kept turns re-sent, vLLM's prefix cache re-using what the last call computed), which
    can drop whole turns (`markovian`) but not thin a KV cache (`turn`, `budget`)."""
    for role, s in session_settings(cfg).items():
        if not s["sessions"] or cfg.serve.backend_of(role) != "vllm":
            continue
        if s["compaction"] in TOKEN_LEVEL_MODES:  # what the client re-sends
            continue
        backend = f"serve.backends.{role}" if role in cfg.serve.backends else "serve.backend"
        key = s["compaction_setting"]
        raise ValueError(
            f"{key}.mode={s['compaction']!r} thins the KV cache of the {role}'s sessions, but "
            f"its servers are vLLM ({backend}: vllm), whose sessions the client keeps and can "
            f"only re-send whole turns. Allowed: {key}.mode: markovian (the prompt and the "
            f"last n_protect_turns turns re-sent) or none, or serve.backends: {{{role}: jax}} "
            "(simloop's engine compacts its KV: markovian, turn, budget)"
        )


def serving_features(cfg: SimloopConfig) -> list[str]:
    """One line per serving role: its backend and replicas, and whether its episodes keep
    sessions (with which compaction, kept where) and why: what `simloop config` prints under
    the YAML."""
    lines = []
    for role, s in session_settings(cfg).items():
        serve = "agent_serve" if role == "agent" else "sim_serve"
        backend = cfg.serve.backend_of(role)
        url = getattr(cfg, role).server_url
        n = cfg.chips.replicas.get(serve, 1)
        pool = " behind a pool (each episode pinned to one)" if n > 1 else ""
        where = f"the server at {url}" if url else f"{n} {backend} replica(s){pool}"
        if s["sessions"] and backend == "vllm":
            state = f"sessions on ({s['setting']}), kept by the client: each call re-sends " + (
                "the prompt and the last turns (markovian), vLLM's prefix cache the rest"
                if s["compaction"] == "markovian"
                else "the whole episode, vLLM's prefix cache re-using what the last call computed"
            )
        elif s["sessions"]:
            state = f"KV sessions on ({s['setting']}), compaction {s['compaction']}"
        else:
            state = f"stateless completions ({s['setting']}: false" + (
                "; vLLM's prefix cache re-uses shared prefixes)" if backend == "vllm" else ")"
            )
        lines.append(f"{role}: {where}; {state}")
    return lines


def role_model(role: RoleConfig) -> ModelConfig:
    """The architecture a role's server will load: its exported weights' config if given."""
    if role.weights and (Path(role.weights) / "model_config.json").is_file():
        return ModelConfig(**json.loads((Path(role.weights) / "model_config.json").read_text()))
    return role.model


def check_local_servers(cfg: SimloopConfig, roles: list[str]) -> None:
    """ValueError when a server this job would start itself (`<role>.server_url` unset) is too
    small for what is sent to it (an episode's context, the simulated shell's prompt) or too
    big for this machine's memory (CPU plans: parameters + KV cache against the RAM)."""
    from launch.config.memory import check_fits, host_memory_bytes, kv_cache_bytes, param_bytes

    engine = cfg.serve.engine
    needs: dict[str, int] = {}
    for role in roles:
        if getattr(cfg, role).server_url is not None:
            continue
        section = cfg.orchestrator if role == "agent" else cfg.env.shell.simulated
        key = "orchestrator" if role == "agent" else "env.shell.simulated"
        asked = section.max_context_tokens
        if cfg.serve.backend_of(role) == "vllm":
            validate.require(
                asked is None or asked <= cfg.vllm.max_model_len,
                section,
                "max_context_tokens",
                f"at most vllm.max_model_len ({cfg.vllm.max_model_len}), the context of the "
                f"{role} vLLM servers",
                owner=key,
            )
            continue  # vLLM sizes its own KV cache from gpu_memory_utilization
        compacting = (role == "agent" and cfg.orchestrator.compacting) or (
            role == "simulator" and cfg.env.shell.simulated.compacting
        )
        # A compacting session holds fewer keys than its episode has tokens: only the slot
        # must fit what a call keeps (the server answers 413 when it does not).
        validate.require(
            asked is None or asked <= engine.max_seq_len or compacting,
            section,
            "max_context_tokens",
            f"at most serve.engine.max_seq_len ({engine.max_seq_len}), the context of the "
            f"{role} server this job starts",
            owner=key,
        )
        model = role_model(getattr(cfg, role))
        needs[f"{role} server parameters"] = param_bytes(model)
        needs[f"{role} server KV cache"] = kv_cache_bytes(
            model, engine.num_slots, engine.max_seq_len
        )
    if needs and cfg.chips.accelerator.startswith("cpu"):
        check_fits(needs, host_memory_bytes())
