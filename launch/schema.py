"""The top-level `SimloopConfig` every subcommand reads: one frozen dataclass per component.

Imports no JAX. Sections grow as components land (server, envs, orchestrator, trainers); a
YAML file only names what it changes from these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from envs.config import ShellConfig, TerminalConfig, TextopsConfig
from launch.deploy_config import ChipsConfig, GkeConfig, TpuVmConfig, VllmConfig
from rl.data.tokenizer import TokenizerConfig
from rl.model.config import MeshConfig, ModelConfig, ShardingConfig, tiny
from rl.orchestrator.config import OrchestratorConfig
from rl.train.config import TrainAgentConfig, TrainSimConfig
from serving.config import EngineConfig, ServerConfig


@dataclass(frozen=True)
class RunConfig:
    """Identity and seeding of one run."""

    name: str = "simloop"
    """Shown in logs and reports; tags cloud resources."""
    seed: int = 0
    """Root PRNG seed; every component derives its keys from it."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"RunConfig.name={self.name!r} is invalid: a non-empty string")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"RunConfig.seed={self.seed!r} is invalid: an integer >= 0")


@dataclass(frozen=True)
class RoleConfig:
    """One model role (the agent or the simulator): architecture, weights, tokenizer, mesh."""

    model: ModelConfig = field(default_factory=tiny)
    """Architecture; `preset: NAME` in YAML starts from a preset."""
    hf_path: str | None = None
    """Local HF directory to load weights (and the architecture) from; None: random init."""
    weights: str | None = None
    """Serving-format weights to start from (`<dir>/params` + `model_config.json`, what
    trainers export, e.g. `runs/sim/weights/final`); wins over `hf_path`."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """`byte` for tiny models, `hf` with a local path otherwise."""
    mesh: MeshConfig = field(default_factory=MeshConfig)
    """Sub-mesh shape of this role's trainer (data x fsdp x tensor devices)."""
    server_url: str | None = None
    """Inference server of this role (simloop serve or vllm-tpu); None: jobs that need one
    start a local `simloop serve` for it."""


@dataclass(frozen=True)
class ServeConfig:
    """`simloop serve`: which role's model to serve, and how."""

    role: Literal["agent", "simulator"] = "agent"
    """The role whose model (and tokenizer) the server loads."""
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass(frozen=True)
class EnvConfig:
    """Where episodes run and what they ask."""

    shell: ShellConfig = field(default_factory=ShellConfig)
    """Backend (`local`, `e2b`, `simulated`) and its settings."""
    terminal: TerminalConfig = field(default_factory=TerminalConfig)
    """Action parsing, observation format and episode limits."""
    textops: TextopsConfig = field(default_factory=TextopsConfig)
    """The seeded CPU task family."""


@dataclass(frozen=True)
class CollectConfig:
    """`simloop collect`: the scripted agent that gathers real trajectories."""

    episodes: int = 128
    """Episodes to run (tasks are taken in order, repeating)."""
    style: str = "two_step"
    """`two_step` (compute, then submit what the shell printed) or `marker` (one turn)."""
    noise: float = 0.2
    """Probability that a turn's reply carries a mistake (another operation's command, a typo,
    a wrong answer), so the data also shows failing commands."""

    def __post_init__(self) -> None:
        from envs.textops import SOLVER_STYLES

        if (
            isinstance(self.episodes, bool)
            or not isinstance(self.episodes, int)
            or self.episodes < 1
        ):
            raise ValueError(
                f"CollectConfig.episodes={self.episodes!r} is invalid: an integer >= 1"
            )
        if self.style not in SOLVER_STYLES:
            raise ValueError(
                f"CollectConfig.style={self.style!r} is invalid: one of {list(SOLVER_STYLES)}"
            )
        if not 0.0 <= self.noise <= 1.0:
            raise ValueError(f"CollectConfig.noise={self.noise!r} is invalid: a number in [0, 1]")


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
    train_sim: TrainSimConfig = field(default_factory=TrainSimConfig)
    """`simloop train-sim`: simulator SFT (mesh: `simulator.mesh`)."""
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
