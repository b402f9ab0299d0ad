"""The demo's stages as one table, for both of its experiments: the thesis demo (`simloop demo`,
`thesis_stages`) and the gating experiment (`--experiment gating`, `gating_stages`). Each row
names the stage's directory under `--out`, the subcommand whose code runs it, what the console
says, the flags that make the stage what it is (its arm, its evaluation) and the inputs that
wire it to what earlier stages wrote (paths, the simulator's token cap).

    stages = thesis_stages(stage_config(args, []))
    records = run_stages(args, out, console, stages)    # {name: its stage.json record}
    servers = stage_servers(args, stages, out)          # [(name, PlannedProcess)], --dry-run

`run_stages` runs a table in order: a finished stage leaves `stage.json`, and running the same
command again skips it (and resumes an interrupted one from its checkpoints). `stage_servers`
plans the servers of the same rows from their flags alone: the inputs exist only once the
earlier stages ran, and none of them changes which servers a stage starts. Each stage runs
the same code as its subcommand (`launch/jobs/collect.py`, `train_sim.py`, `eval_sim.py`,
`train_agent.py`); the gating experiment's weak simulator is a train-sim on a doctored
collection (`weak_sim`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launch.config import load_config, write_config
from launch.config.schema import SimloopConfig
from launch.errors import JobError, UsageError
from rl.data import rundir

START_POINTS = ("--simulator.weights", "--agent.weights")
"""The user's flags that name where the demo's models start, not what later stages run on."""


def split_start_points(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the `START_POINTS` flags with their values, every other override), each in order;
    `--flag value` and `--flag=value` alike."""
    starts: list[str] = []
    rest: list[str] = []
    k = 0
    while k < len(overrides):
        flag = overrides[k]
        name, eq, _ = flag.partition("=")
        if name not in START_POINTS:
            rest.append(flag)
        elif eq:
            starts.append(flag)
        else:
            starts += overrides[k : k + 2]
            k += 1
        k += 1
    return starts, rest


def stage_config(args: argparse.Namespace, stage_overrides: list[str]) -> SimloopConfig:
    """The config of one stage: the file, `--quick`'s overrides, the user's `START_POINTS`,
    the stage's own (its flags and inputs), then the user's other overrides (which win). A
    user's `--simulator.weights` is thus where train-sim starts, as the stateful experiment's
    pretrained simulator is, and arm (c) and RL in the simulator run on what train-sim made
    from it (likewise `--agent.weights` and the warm start)."""
    starts, rest = split_start_points(args.overrides)
    return load_config(
        SimloopConfig, args.config, args.quick_overrides + starts + stage_overrides + rest
    )


@dataclass
class Done:
    """What the stages run so far left: their directories under `out` and their records."""

    out: Path
    records: dict[str, dict] = field(default_factory=dict)

    def dir(self, name: str) -> Path:
        return self.out / name


def _none(done: Done) -> list[str]:
    return []


@dataclass(frozen=True)
class Stage:
    """One row of a demo's table."""

    name: str
    """Its directory under `--out` and its key in `summary.json`'s `stages`."""
    job: str
    """What runs it (`RUNNERS`): collect, train-sim, eval-sim, train-agent, or weak-sim."""
    title: str
    """Its name in the console's `k/N title: text` line."""
    text: str
    flags: tuple[str, ...] = ()
    """The overrides that make it what it is; the dry run plans its servers from these."""
    inputs: Callable[[Done], list[str]] = _none
    """The overrides naming what earlier stages wrote; they come before `flags`."""
    runs: bool = True
    """False: this config leaves the stage out (the console numbers only those that run)."""


# ----- the two tables ---------------------------------------------------------------------------

ARMS = ("real_only", "ungated", "gated")
"""The gating experiment's RL arms, each a stage."""


def _collection(done: Done) -> str:
    return str(done.dir("collect") / rundir.TRAJECTORIES)


def _weights(done: Done, stage: str, name: str) -> str:
    """What stage `stage` exported as `name` (`<out>/<stage>/weights/<name>`)."""
    return str(done.dir(stage) / rundir.WEIGHTS / name)


def _sim_data(done: Done) -> list[str]:
    """The simulator's training data (the collection) and its token cap, which the collect
    stage derived from the real observations."""
    flags = ["--train_sim.trajectories", json.dumps([_collection(done)])]
    cap = done.records["collect"].get("sim_max_tokens")
    if cap is not None:
        flags += ["--env.shell.simulated.max_tokens", str(cap)]
    return flags


def _trained_sim(done: Done) -> list[str]:
    """What the thesis stages after train-sim run on: its final weights."""
    return _sim_data(done) + ["--simulator.weights", _weights(done, "sim", "final")]


def _weak_sim_weights(done: Done) -> list[str]:
    """What the gating stages after the weak simulator run on: the weights its stage names."""
    return _sim_data(done) + ["--simulator.weights", done.records["sim"]["weights"]]


def _replayed(simulator: Callable[[Done], list[str]]) -> Callable[[Done], list[str]]:
    """eval-sim's inputs: the simulator, and the held-out real commands to replay."""

    def inputs(done: Done) -> list[str]:
        return simulator(done) + [
            "--eval_sim.trajectories",
            json.dumps([_collection(done)]),
            "--eval_sim.heldout_tasks",
            str(done.dir("sim") / rundir.HELDOUT_TASKS),
        ]

    return inputs


def _wide_replayed(done: Done) -> list[str]:
    """The wider arm (c)'s inputs: the trained simulator and the whole wider collection (none
    of its tasks is among those the simulator trained on)."""
    return _trained_sim(done) + [
        "--eval_sim.trajectories",
        json.dumps([str(done.dir("collect_wide") / rundir.TRAJECTORIES)]),
    ]


def wide_flags(base: SimloopConfig) -> tuple[list[str], list[str]]:
    """(the wider held-out collection's flags, its arm (c)'s): `demo.wide_heldout_overrides`
    with `demo.wide_heldout_episodes` episodes on as many tasks; eval-sim replays them under
    the same overrides (the same turn limit and shell)."""
    d = base.demo
    n = str(d.wide_heldout_episodes)
    over = list(d.wide_heldout_overrides)
    return [*over, "--collect.episodes", n, "--collect.num_tasks", n], over


def _control_arm(done: Done) -> list[str]:
    """The thesis control arm's inputs: the trained simulator and stage agent's warm start."""
    return _trained_sim(done) + ["--agent.weights", _weights(done, "agent", "warm_start")]


def _gating_arm(done: Done) -> list[str]:
    """A gating arm's inputs: the weak simulator, stage warm's warm start and, when the weak
    simulator learned from a doctored collection, that collection (co-training replays it)."""
    flags = _weak_sim_weights(done) + ["--agent.weights", _weights(done, "warm", "warm_start")]
    if done.records["sim"].get("data"):
        flags += ["--train_sim.trajectories", json.dumps([done.records["sim"]["data"]])]
    return flags


def thesis_stages(base: SimloopConfig) -> list[Stage]:
    """`simloop demo`: collect, train-sim, eval-sim (arm c), train-agent (RL in `demo.rl_arm`),
    the control arm (RL in the real shell from the same warm start, same episodes) and, with
    `demo.trials`, several trials per episode; `base` is the demo's config."""
    d = base.demo
    wide = wide_flags(base)
    return [
        Stage("collect", "collect", "collect", "scripted noisy agent in the real shell"),
        Stage("sim", "train-sim", "train-sim", "simulator SFT on the real trajectories",
              inputs=_sim_data),
        Stage("eval_sim", "eval-sim", "eval-sim",
              "arm (c): held-out real commands vs the simulator",
              inputs=_replayed(_trained_sim)),
        Stage("collect_wide", "collect", "collect",
              "a wider held-out collection (demo.wide_heldout_overrides)",
              flags=tuple(wide[0]), runs=bool(d.wide_heldout_episodes)),
        Stage("eval_sim_wide", "eval-sim", "eval-sim",
              "arm (c) on it: deeper turns, state distance 3+",
              flags=tuple(wide[1]), inputs=_wide_replayed, runs=bool(d.wide_heldout_episodes)),
        Stage("agent", "train-agent", "train-agent", f"SFT warm start, then RL ({d.rl_arm})",
              flags=("--orchestrator.arm", d.rl_arm,
                     "--train_agent.eval.arms", json.dumps(list(d.eval_arms))),
              inputs=_trained_sim),
        Stage("agent_real", "train-agent", "train-agent",
              "the control: RL in the real shell, same warm start",
              flags=("--train_agent.warm_start.steps", "0", "--orchestrator.arm", "real",
                     "--train_agent.eval.arms", json.dumps(["real"]),
                     # measured in stage agent, same policy and seeds
                     "--train_agent.eval.before", "false"),
              inputs=_control_arm, runs=d.real_rl),
        Stage("trials", "train-agent", "train-agent",
              f"{d.trials} trials per episode, hidden operations",
              flags=tuple(trials_flags(base)), inputs=_trained_sim, runs=bool(d.trials)),
    ]  # fmt: skip


def trials_flags(base: SimloopConfig) -> list[str]:
    """The `trials` stage's flags: K trials, turns for all of them (`max_turns` bounds the
    episode: K x `turns_per_trial`, as the overrides set it), the demo's `trials_overrides`,
    the real shell."""
    k, over = base.demo.trials, list(base.demo.trials_overrides)
    per = base.env.terminal.turns_per_trial or base.env.terminal.max_turns
    if "--env.terminal.turns_per_trial" in over[:-1]:
        per = int(over[over.index("--env.terminal.turns_per_trial") + 1])
    return [
        "--env.terminal.trials", str(k), "--env.terminal.max_turns", str(k * per), *over,
        "--orchestrator.arm", "real", "--train_agent.eval.arms", json.dumps(["real"]),
    ]  # fmt: skip


def gating_stages(base: SimloopConfig) -> list[Stage]:
    """`simloop demo --experiment gating`: collect, the weak simulator, its fidelity, the SFT
    warm start, then RL from it in each of `ARMS` (`arm_flags`)."""
    d = base.demo
    steps, wrong = d.gating_sim_steps, list(d.gating_wrong_ops)
    weak = f"a weak simulator: {steps} train-sim steps" + (
        f", on the collection with {' and '.join(wrong)} misreported" if steps and wrong else ""
    )
    from_warm = [
        "--train_agent.warm_start.steps",
        "0",
        "--train_agent.eval.arms",
        json.dumps(["real"]),
    ]
    if d.gating_eval_tasks:
        from_warm += ["--train_agent.eval.tasks", str(d.gating_eval_tasks)]
    return [
        Stage("collect", "collect", "collect", "scripted noisy agent in the real shell"),
        Stage("sim", "weak-sim", "sim", weak, inputs=_sim_data),
        Stage(
            "eval_sim",
            "eval-sim",
            "eval_sim",
            "arm (c): the weak simulator's fidelity",
            inputs=_replayed(_weak_sim_weights),
        ),
        Stage(
            "warm",
            "train-agent",
            "warm",
            "SFT warm start (no RL)",
            flags=("--train_agent.steps", "0"),
            inputs=_weak_sim_weights,
        ),
        *(
            Stage(arm, "train-agent", arm, text, flags=(*from_warm, *flags), inputs=_gating_arm)
            for arm, (flags, text) in arm_flags(base).items()
        ),
    ]


def arm_flags(base: SimloopConfig) -> dict[str, tuple[list[str], str]]:
    """Each gating RL arm's flags (beside the warm start's) and what it is."""
    return {
        "real_only": (["--orchestrator.arm", "real"], "RL in the real shell"),
        "ungated": (
            ["--orchestrator.arm", "closed_loop", "--train_agent.eval.before", "false"],
            "RL in the weak simulator, ungated",
        ),
        "gated": (
            [
                "--orchestrator.arm",
                "gated",
                "--train_agent.eval.before",
                "false",
                *base.demo.gating_overrides,
            ],
            "RL gated by live fidelity, co-training",
        ),
    }


# ----- running a table --------------------------------------------------------------------------


def read_stage(path: Path) -> dict | None:
    f = path / rundir.STAGE
    return json.loads(f.read_text()) if f.exists() else None


def write_stage(path: Path, record: dict) -> None:
    (path / rundir.STAGE).write_text(json.dumps(record, indent=1))


def run_stages(
    args: argparse.Namespace,
    out: Path,
    console,
    stages: Sequence[Stage],
) -> dict[str, dict]:
    """Run `stages` in order, skipping finished ones; every stage's record by name."""
    done = Done(out)
    running = [stage for stage in stages if stage.runs]
    for k, stage in enumerate(running, start=1):
        path = done.dir(stage.name)
        console.rule(f"[bold]{k}/{len(running)} {stage.title}[/]: {stage.text}")
        record = read_stage(path)
        if record is not None:
            console.print(f"simloop demo: {stage.title} done: skipped (delete {path} to redo it)")
        else:
            overrides = stage.inputs(done) + list(stage.flags)
            record = RUNNERS[stage.job](args, path, overrides, done)
        done.records[stage.name] = record
    return done.records


def stage_servers(args: argparse.Namespace, stages: Sequence[Stage], out: Path) -> list[tuple]:
    """`(stage, PlannedProcess)` for every server the stages that run start, in order, each
    reading its stage's own config (`<out>/<stage>/config.yaml`)."""
    from launch.deploy.processes import job_processes
    from rl.session import published_roles, server_roles

    procs = []
    for stage in stages:
        if not stage.runs or stage.job not in ("eval-sim", "train-agent"):
            continue  # collect and train-sim start no server
        cfg = stage_config(args, list(stage.flags))
        if stage.job == "eval-sim":
            roles, publishes = ["simulator"], []
        else:
            roles = server_roles(cfg.train_agent, cfg.orchestrator)
            publishes = published_roles(cfg.train_agent, cfg.orchestrator)
        planned = job_processes(cfg, stage.job, roles, out / stage.name, publishes=publishes)
        procs += [(stage.name, p) for p in planned if p.kind == "serve"]  # the rest: the demo
    return procs


# ----- the stages' runners: (args, stage dir, overrides, done) -> the stage's record ------------


def _collect(args, path: Path, overrides: list[str], done: Done) -> dict:
    import asyncio

    from launch.jobs.collect import collect

    cfg = stage_config(args, overrides)
    write_config(cfg, path)
    began = time.perf_counter()
    summary = asyncio.run(collect(cfg, path))
    record = {
        "wall_s": round(time.perf_counter() - began, 1),
        **_pick(summary, "episodes", "status", "success_rate"),
    }
    if cfg.demo.sim_max_tokens_from_data:
        record["sim_max_tokens"] = _suggest_cap(cfg, path / rundir.TRAJECTORIES)
    print(
        f"simloop demo: collected {summary['episodes']} episodes {summary['status']} "
        f"(scripted success {summary['success_rate']:.2f})"
        + (
            f"; simulator token cap {record['sim_max_tokens']}"
            if "sim_max_tokens" in record
            else ""
        )
    )
    write_stage(path, record)
    return record


def _suggest_cap(cfg: SimloopConfig, trajectories: Path) -> int:
    """`env.shell.simulated.max_tokens` from the real observations' token lengths (in the
    simulator's format, with its end-of-turn token; `demo.sim_max_tokens_quantile` of them),
    at most what the simulator's context (`env.shell.simulated.max_context_tokens`) leaves
    beside a prompt: beside `max_prompt_tokens` when set, else half of it."""
    from envs.fidelity import suggest_max_tokens
    from rl.data import load_tokenizer
    from rl.data.sim_format import format_observation
    from rl.data.trajectory import load_trajectories

    tok = load_tokenizer(cfg.simulator.tokenizer)
    lengths = [
        len(tok.encode(format_observation(t.observation, t.exit_code or 0))) + 1
        for traj in load_trajectories([trajectories])
        for t in traj.turns
        if t.observation is not None
    ]
    cap = suggest_max_tokens(lengths, quantile=cfg.demo.sim_max_tokens_quantile)
    sim = cfg.env.shell.simulated
    context = sim.max_context_tokens
    if context is None:
        return cap
    room = context // 2 if sim.max_prompt_tokens is None else context - sim.max_prompt_tokens
    if cap > room:
        print(
            f"simloop demo: the observations suggest a simulator token cap of {cap}; it is "
            f"clamped to {room}, what the simulator's {context}-token context leaves beside "
            "its prompt"
        )
        cap = room
    return cap


def _train_sim(
    args,
    path: Path,
    overrides: list[str],
    done: Done,
    extra: dict | None = None,
) -> dict:
    """Run train-sim as a stage; its `stage.json` record (with `extra` merged in)."""
    from launch.jobs import train_sim

    cfg = stage_config(args, overrides)
    began = time.perf_counter()
    rc = train_sim.run(argparse.Namespace(out=str(path)), cfg)
    if rc != 0:
        raise JobError(f"train-sim failed (exit {rc})")
    losses = [
        r
        for r in rundir.read_metrics(path / rundir.METRICS)
        if r.get("stage") == "sim_sft" and "loss" in r
    ]
    last = losses[-1] if losses else {}
    heldout = json.loads((path / rundir.HELDOUT_TASKS).read_text())
    record = {
        "wall_s": round(time.perf_counter() - began, 1),
        "steps": cfg.train_sim.steps,
        "loss": last.get("loss"),
        "weights": str(path / rundir.WEIGHTS / "final"),
        "heldout_tasks": len(heldout),
        "simulator": describe_simulator(cfg, path),
        **(extra or {}),
    }
    write_stage(path, record)
    return record


_PRETRAIN_KEYS = ("examples", "drill_examples", "steps", "wall_s", "command", "exact", "textops")


def describe_simulator(cfg: SimloopConfig, sim_dir: Path) -> dict:
    """What the report says the simulator is: its size, where it started, what it saw."""
    from rl.model.params_io import read_model_config

    model = read_model_config(sim_dir / rundir.WEIGHTS / "final")
    start = cfg.simulator.weights
    pretrained = rundir.read_json(Path(start) / "pretrain_sim.json") if start else None
    examples = [
        r
        for r in rundir.read_metrics(sim_dir / rundir.METRICS)
        if r.get("stage") == "train_sim_data"
    ]
    return {
        "params": model.num_params(),
        "layers": model.num_layers,
        "hidden": model.hidden_size,
        "heads": model.num_heads,
        "started_from": start or "random initialisation",
        "pretrained_on": None
        if not pretrained
        else {
            **{k: pretrained.get(k) for k in _PRETRAIN_KEYS},
            "lineage": [
                {k: r.get(k) for k in _PRETRAIN_KEYS} for r in pretrained.get("lineage") or []
            ],
        },
        "fine_tuned_on": examples[-1] if examples else None,
        "fine_tune_steps": cfg.train_sim.steps,
    }


def _weak_sim(args, path: Path, overrides: list[str], done: Done) -> dict:
    """The gating experiment's weak simulator: `demo.gating_sim_steps` train-sim steps, on the
    collection with the `demo.gating_wrong_ops` operations misreported (`envs.textops.
    misreport`: those commands print their input), or (0 steps) the configured simulator
    weights as they are, with the same held-out split train-sim would have written."""
    cfg = stage_config(args, overrides)
    steps, wrong = cfg.demo.gating_sim_steps, list(cfg.demo.gating_wrong_ops)
    if steps > 0:
        flags = ["--train_sim.steps", str(steps)]
        made = {}
        if wrong:
            data = path / "data" / rundir.TRAJECTORIES
            made = {
                "wrong_ops": wrong,
                "data": str(data.absolute()),
                "misreported_turns": _misreported(_collection(done), data, wrong),
            }
            flags += ["--train_sim.trajectories", json.dumps([made["data"]])]
        return _train_sim(args, path, overrides + flags, done, made)
    from envs.tasks import is_heldout
    from rl.data.trajectory import load_trajectories

    if not cfg.simulator.weights:
        raise UsageError(
            "demo.gating_sim_steps=0 takes the simulator as it is: set "
            "simulator.weights (the demo config's pretrained one)"
        )
    write_config(cfg, path)
    ids = {t.task_id for t in load_trajectories(cfg.train_sim.trajectories)}
    held = sorted(i for i in ids if is_heldout(i, cfg.train_sim.heldout_fraction))
    (path / rundir.HELDOUT_TASKS).write_text(json.dumps(held, indent=1))
    record = {
        "wall_s": 0.0,
        "steps": 0,
        "weights": str(Path(cfg.simulator.weights).absolute()),
        "heldout_tasks": len(held),
    }
    write_stage(path, record)
    return record


def _misreported(collected: str, out: Path, ops: list[str]) -> int:
    """Write the collection under `out` with `ops` misreported; how many turns changed."""
    import dataclasses

    from envs.textops import INPUT_FILE, misreport
    from rl.data.trajectory import load_trajectories, write_jsonl

    rewritten, changed = [], 0
    for t in load_trajectories([collected]):
        turns, n = misreport(t.turns, t.setup_files.get(INPUT_FILE, "").strip(), ops)
        if n:  # the sampled token view no longer matches the text: the episode keeps none
            turns = [dataclasses.replace(turn, token_span=None) for turn in turns]
            t = dataclasses.replace(
                t,
                token_ids=[],
                loss_mask=[],
                behavior_logprobs=None,
                policy_version=None,
                source="rendered",
            )
        rewritten.append(dataclasses.replace(t, turns=turns))
        changed += n
    if not changed:
        raise JobError(
            f"demo.gating_wrong_ops={ops}: no collected command ran them (nothing to misreport)"
        )
    write_jsonl(out / "misreported-00000.jsonl", rewritten)
    return changed


def _eval_sim(args, path: Path, overrides: list[str], done: Done) -> dict:
    from launch.jobs.eval_sim import eval_sim, print_fidelity, select_trajectories

    cfg = stage_config(args, overrides)
    trajs = select_trajectories(cfg)
    if not trajs:
        raise JobError("no held-out real trajectory to replay for eval-sim")
    write_config(cfg, path)
    began = time.perf_counter()
    result = eval_sim(cfg, path, trajs)
    print_fidelity(result)
    record = {"wall_s": round(time.perf_counter() - began, 1), "trajectories": len(trajs)}
    write_stage(path, record)
    return record


def _train_agent(args, path: Path, overrides: list[str], done: Done) -> dict:
    import asyncio

    from launch.jobs.train_agent import train_agent

    cfg = stage_config(args, overrides)
    write_config(cfg, path)
    began = time.perf_counter()
    summary = asyncio.run(train_agent(cfg, path))
    record = {
        "wall_s": round(time.perf_counter() - began, 1),
        "rl_arm": cfg.orchestrator.arm,
        **summary,
    }
    write_stage(path, record)
    return record


def _pick(d: dict, *keys: str) -> dict:
    return {k: d[k] for k in keys if k in d}


RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "collect": _collect,
    "train-sim": _train_sim,
    "weak-sim": _weak_sim,
    "eval-sim": _eval_sim,
    "train-agent": _train_agent,
}
