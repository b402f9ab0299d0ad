"""`simloop pretrain-sim`: the simulator learns to compute terminal output from its context.

    simloop pretrain-sim --config configs/demo_cpu.yaml --out runs/pretrain-sim

1. Collects real-bash transcripts of a utility grammar (`envs.shellgrammar`: fresh random words
   and files, `rev`/`tr`/`sort`/`fold`/`cut`/`head`/`wc`/`grep`/`sed`/`printf`/`cat`/`echo`,
   pipes, typos, missing files) into `trajectories/grammar-{train,eval}.jsonl`, each workspace
   run by `LocalShell` exactly as an episode's commands are; with `drill_cases`, also a second
   grammar's (`drill`, e.g. counts alone) into `grammar-drill.jsonl`, trained on alongside.
2. Trains `simulator.model` on them with the simulated shell's own prompts
   (`env.shell.simulated`), loss on observation tokens only: first `short_steps` on short rows
   (the word a few dozen bytes before the output, where copying forms soonest), then on all.
3. Every `eval_every` steps scores held-out workspaces: greedy exact match per kind (the
   textops operations in the agent's own command shape, the rest of the grammar) and an
   induction score (does it continue a repeated random string); `metrics.jsonl` holds the
   learning curves, `pretrain_sim.json` the last evaluation.

Writes `weights/final` (serving format), which `train-sim` starts from with
`--simulator.weights runs/pretrain-sim/weights/final`. Running the same command again resumes
from the newest checkpoint and reuses the collected transcripts.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import string
import time
from pathlib import Path
from typing import Any

from launch.config import write_config
from launch.config.schema import SimloopConfig
from launch.errors import UsageError
from rl.data import rundir

TRAIN_FILE, EVAL_FILE = "grammar-train.jsonl", "grammar-eval.jsonl"
DRILL_FILE = "grammar-drill.jsonl"
RESULT = "pretrain_sim.json"
TEXTOPS_KINDS = ("reverse", "upper", "sort", "count")
INDUCTION_ROWS, INDUCTION_LEN = 64, 16


def transcripts(path: Path, cfg: Any, n: int, *, offset: int, concurrency: int) -> list:
    """The grammar's cases `offset..offset+n-1` run in real bash, one trajectory per command
    (and one per session of `cfg.session_turns` commands), read back from `path` when an
    earlier run wrote it."""
    from envs.shellgrammar import run_cases, sample_cases
    from rl.data.trajectory import Trajectory, Turn, load_trajectories, write_jsonl

    if path.exists():
        return load_trajectories([path])
    cases = sample_cases(cfg, n, offset=offset)
    began = time.perf_counter()
    step = max(1, n // 10)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            rate = done / max(time.perf_counter() - began, 1e-9)
            print(
                f"simloop pretrain-sim: {path.name}: {done}/{total} workspaces in real bash "
                f"({rate:.0f}/s)",
                flush=True,
            )

    results = asyncio.run(run_cases(cases, concurrency=concurrency, progress=progress))
    trajs = []
    for i, res in enumerate(results, start=offset):
        turns = [
            Turn(agent_text=c.text, command=c.text, observation=output, exit_code=code)
            for c, (output, code) in zip(res.case.commands, res.outputs, strict=True)
        ]
        # No task, so no reward to earn: 0.0 (the schema wants a number for real episodes).
        common = dict(
            arm="real", env_backend="local", status="ok", reward=0.0, setup_files=res.case.files
        )
        for j, (turn, cmd) in enumerate(zip(turns, res.case.commands, strict=True)):
            trajs.append(
                Trajectory(
                    task_id=f"grammar-{cfg.seed}-{i}-{j}",
                    turns=[turn],
                    task_kind=cmd.kind,
                    **common,
                )
            )
        if res.case.session and len(turns) > 1:
            trajs.append(
                Trajectory(
                    task_id=f"grammar-{cfg.seed}-{i}-s",
                    turns=turns[: cfg.session_turns],
                    task_kind="session",
                    **common,
                )
            )
    write_jsonl(path, trajs)
    return trajs


def kind_group(kind: str) -> str:
    """The row of the learning-curve table a kind is counted in."""
    if kind in TEXTOPS_KINDS:
        return kind
    if kind.endswith(":typo") or kind == "grammar:error":
        return "errors_typos"
    return kind.split(":", 1)[0]  # bare / grammar / session


def induction_examples(seed: int) -> list[dict]:
    """Rows of a random lowercase string then the same string again, loss on the repeat: a
    model with induction heads continues it exactly (the phase change to watch for)."""
    import numpy as np

    from rl.data.tokenizer import ByteTokenizer

    tok, rng = ByteTokenizer(), random.Random(seed)
    rows = []
    for _ in range(INDUCTION_ROWS):
        s = "".join(rng.choice(string.ascii_lowercase) for _ in range(INDUCTION_LEN))
        ids = tok.encode(f"{s}\n{s}\n")
        mask = np.zeros(len(ids), np.int32)
        mask[INDUCTION_LEN + 2 :] = 1  # predicting the repeat after its first letter
        rows.append({"tokens": np.asarray(ids, np.int32), "loss_mask": mask})
    return rows


def lineage(weights: str | None) -> list[dict]:
    """The pretraining runs behind `weights`, oldest first: each one's record (its command,
    steps, wall, data, grammar, last evaluation and learning curve) from the
    `pretrain_sim.json` the weights carry. Empty when they carry none (random or foreign
    weights)."""
    record = rundir.read_json(Path(weights) / RESULT) if weights else None
    if not isinstance(record, dict):
        return []
    older = record.get("lineage") or []
    own = {k: v for k, v in record.items() if k not in ("lineage", "total_steps")}
    return [*older, own]


class StagedBatches:
    """Batches from one dataset per curriculum stage: `stages[k] = (pulls, dataset)`, the
    last stage open-ended. Saves and restores its position (stage, pulls, the stage's
    iterator) in checkpoints like a grain iterator."""

    def __init__(self, stages: list[tuple[int | None, Any]]):
        self.stages, self.k, self.pulled = stages, 0, 0
        self.it = iter(stages[0][1])

    def __iter__(self) -> StagedBatches:
        return self

    def __next__(self) -> dict:
        while self.k < len(self.stages) - 1 and self.pulled >= (self.stages[self.k][0] or 0):
            self.k += 1
            self.it = iter(self.stages[self.k][1])
        self.pulled += 1
        return next(self.it)

    def get_state(self) -> dict:
        return {"stage": self.k, "pulled": self.pulled, "inner": self.it.get_state()}

    def set_state(self, state: dict) -> None:
        self.k, self.pulled = int(state["stage"]), int(state["pulled"])
        self.it = iter(self.stages[self.k][1])
        self.it.set_state(state["inner"])


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        raise UsageError("--out DIR is required")
    p = cfg.pretrain_sim
    out = Path(args.out)
    write_config(cfg, out)
    from launch.deploy.chips import trainer_device_ids
    from rl.data import load_tokenizer
    from rl.data.datasets import labelled_sim_examples, packed_dataset, sim_sft_examples
    from rl.model.integrity import write_manifest
    from rl.train.build import build_trainer, export_weights
    from rl.train.checkpoint import Checkpointer
    from rl.train.loop import greedy_exact_by_group, resume, sft_loop
    from rl.train.multihost import barrier

    tdir = out / rundir.TRAJECTORIES

    def run_or_read() -> tuple[list, list, list]:
        train = transcripts(
            tdir / TRAIN_FILE, p.grammar, p.cases, offset=0, concurrency=p.concurrency
        )
        held = transcripts(
            tdir / EVAL_FILE, p.grammar, p.eval_cases, offset=p.cases, concurrency=p.concurrency
        )
        drill = (
            transcripts(
                tdir / DRILL_FILE, p.drill, p.drill_cases, offset=0, concurrency=p.concurrency
            )
            if p.drill_cases
            else []
        )
        return train, held, drill

    # Several processes: process 0 runs the workspaces in bash and writes the transcripts,
    # the others read them once written.
    made = run_or_read() if rundir.is_writer() else None
    barrier("simloop pretrain-sim transcripts written", timeout_s=4 * 3600.0)
    train, held, drill = made or run_or_read()
    tok = load_tokenizer(cfg.simulator.tokenizer)
    sim = cfg.env.shell.simulated
    prompt = dict(
        system_prompt=sim.system_prompt, show_task=sim.show_task, context_budget=sim.prompt_budget
    )
    built = dict(
        max_len=p.data.seq_len + 1,
        cut_targets=p.data.cut_targets,
        exit_code_weight=p.data.exit_code_weight,
    )
    examples, stats = sim_sft_examples(train, tok, **built, **prompt)
    drilled, n_drill = "", 0
    if drill:
        extra, extra_stats = sim_sft_examples(drill, tok, **built, **prompt)
        share = extra_stats.target_tokens / (stats.target_tokens + extra_stats.target_tokens)
        drilled = f" + {extra_stats.examples} drill examples ({share:.0%} of target tokens)"
        examples, n_drill = examples + extra, extra_stats.examples
    short = [e for e in examples if len(e["tokens"]) <= p.short_data.seq_len + 1]
    evals, kinds = labelled_sim_examples(
        [t for t in held if t.task_kind != "session"],
        lambda t: t.task_kind,
        tok,
        max_len=p.data.seq_len + 1,
        **prompt,
    )
    # A session's later commands, each after the turns before it: the "session" row.
    later, _ = labelled_sim_examples(
        [t for t in held if t.task_kind == "session"],
        lambda t: "session",
        tok,
        min_turn=1,
        max_len=p.data.seq_len + 1,
        **prompt,
    )
    evals, kinds = evals + later, kinds + ["session"] * len(later)
    cut = stats.cut_targets + (extra_stats.cut_targets if drill else 0)
    print(
        f"simloop pretrain-sim: {len(train)} transcripts -> {stats.examples} examples"
        f"{drilled} ({len(short)} short{f', {cut} cut to fit' if cut else ''}), "
        f"{stats.target_tokens} target tokens; {len(evals)} held out",
        flush=True,
    )

    trainer = build_trainer(
        cfg.simulator,
        tok,
        optim=p.optim,
        steps=p.steps,
        loss="sft",
        rules=cfg.sharding.rules,
        seed=cfg.run.seed,
        device_ids=trainer_device_ids(cfg, "simulator"),
    )
    stages: list[tuple[int | None, Any]] = []
    if p.short_steps and short:
        stages.append((p.short_steps, packed_dataset(short, p.short_data, pad_id=tok.pad_id)))
    stages.append((None, packed_dataset(examples, p.data, pad_id=tok.pad_id)))
    batches = StagedBatches(stages)
    rows = max(8, p.data.batch_size)
    groups = [kind_group(k) for k in kinds]
    induction = induction_examples(cfg.run.seed)
    log = rundir.MetricsLog(out)
    result: dict[str, Any] = {}

    def evaluate(step: int) -> None:
        r = greedy_exact_by_group(trainer, evals, groups, batch_size=rows, pad_id=tok.pad_id)
        ind = greedy_exact_by_group(
            trainer, induction, ["induction"] * len(induction), batch_size=rows, pad_id=tok.pad_id
        )
        by = r["by_group"]
        textops = [by[k] * r["counts"][k] for k in TEXTOPS_KINDS if k in by]
        n_textops = sum(r["counts"].get(k, 0) for k in TEXTOPS_KINDS)
        rec = {
            "stage": "pretrain_sim_eval",
            "step": step,
            "exact": r["exact"],
            "textops": sum(textops) / n_textops if n_textops else float("nan"),
            "induction": ind["exact"],
            **{f"exact_{g}": v for g, v in by.items()},
        }
        log.write(rec)
        result.update(rec, counts=r["counts"])
        shown = " ".join(f"{g} {v:.2f}" for g, v in by.items())
        print(
            f"simloop pretrain-sim: step {step}: held-out greedy exact {rec['exact']:.3f} "
            f"(textops {rec['textops']:.3f}; {shown}); induction {rec['induction']:.2f}",
            flush=True,
        )

    seen = {"step": 0}

    def on_log(last: dict) -> None:
        # Logs come every log_every steps (and at saves): evaluate at the first log past each
        # multiple of eval_every, whether or not the two divide each other.
        step = int(last["step"])
        if step // p.eval_every > seen["step"] // p.eval_every or step == p.steps:
            evaluate(step)
        seen["step"] = step

    with Checkpointer(out / rundir.CHECKPOINTS, p.checkpoint) as ckpt:
        earlier_wall = 0.0
        if resume(trainer, ckpt, batches) is not None:
            print(f"simloop pretrain-sim: resuming at step {trainer.step_count}", flush=True)
            # The training wall of the invocations before this one (as their last record says).
            earlier_wall = float((rundir.read_json(out / RESULT) or {}).get("wall_s") or 0.0)
        seen["step"] = trainer.step_count
        summary = sft_loop(
            trainer,
            batches,
            steps=p.steps,
            log=log,
            stage="pretrain_sim",
            log_every=p.log_every,
            ckpt=ckpt,
            ckpt_every=p.checkpoint.every_steps,
            on_log=on_log,
        )
    if not result:
        evaluate(trainer.step_count)
    path = export_weights(trainer, out, "final", p.checkpoint)
    result.update(
        weights=str(path),
        steps=summary["steps"],
        wall_s=round(earlier_wall + summary["wall_s"], 1),  # training, every invocation
        examples=stats.examples,
        params=trainer.model_cfg.num_params(),
        command=" ".join(
            [
                "simloop pretrain-sim",
                *(["--config", args.config] if getattr(args, "config", None) else []),
                "--out",
                str(args.out),
                *getattr(args, "overrides", []),
            ]
        ),
        grammar=dataclasses.asdict(p.grammar),
    )
    if p.drill_cases:
        result.update(
            drill=dataclasses.asdict(p.drill), drill_cases=p.drill_cases, drill_examples=n_drill
        )
    # The whole learning curve (a resumed run's earlier evaluations included), by step.
    curve = {
        r["step"]: {k: v for k, v in r.items() if k != "stage"}
        for r in rundir.read_metrics(out / rundir.METRICS)
        if r.get("stage") == "pretrain_sim_eval"
    }
    result["curve"] = [curve[k] for k in sorted(curve)]
    earlier = lineage(cfg.simulator.weights)
    if earlier:  # it continued another pretraining: the record says which, and what it cost
        result["lineage"] = earlier
        result["total_steps"] = summary["steps"] + sum(int(r.get("steps") or 0) for r in earlier)
    text = json.dumps(result, indent=1)
    if rundir.is_writer():  # process 0 of a multi-process job
        (out / RESULT).write_text(text)
        (path / RESULT).write_text(text)  # travels with the weights (the report reads it)
        write_manifest(path)  # sealed again with the record in it, or no server would load them
    print(
        f"simloop pretrain-sim: {summary['steps']} steps in {summary['wall_s']:.0f}s; "
        f"held-out exact {result['exact']:.3f}, textops {result['textops']:.3f} -> {path}"
    )
    return 0
