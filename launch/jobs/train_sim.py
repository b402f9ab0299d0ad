"""`simloop train-sim`: supervised fine-tuning of the simulator on real trajectories.

    simloop train-sim --config configs/demo_cpu.yaml --out runs/sim \\
        --train_sim.trajectories '[runs/collect/trajectories]'

Writes `config.yaml`, `metrics.jsonl`, `heldout_tasks.json`, `checkpoints/` and
`weights/final` into `--out`, shows progress, and resumes from the newest checkpoint when
`--out` already holds one (run the same command again after a crash).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from launch.config import write_config
from launch.config.schema import SimloopConfig, role_model
from launch.errors import JobError, UsageError
from rl.data import rundir


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    if not args.out:
        raise UsageError("--out DIR is required")
    tcfg = cfg.train_sim
    if not tcfg.trajectories:
        raise UsageError(
            "train_sim.trajectories is empty: point it at real trajectories "
            "(JSONL files or folders from `simloop collect` / `simloop import`), e.g. "
            "--train_sim.trajectories '[runs/collect/trajectories]'"
        )
    out = Path(args.out)
    write_config(cfg, out)
    from rl.train.loop import TrainingDiverged

    try:
        return _train_sim(cfg, out)
    except TrainingDiverged as e:
        raise JobError(str(e)) from e


def _train_sim(cfg: SimloopConfig, out: Path) -> int:
    from envs.tasks import is_heldout
    from launch.config.memory import check_trainer_memory
    from launch.deploy.chips import trainer_device_ids
    from rl.data import load_tokenizer
    from rl.data.datasets import sim_sft_dataset
    from rl.data.sim_format import PROMPT_LAYOUT_FILE, prompt_layout_record
    from rl.data.trajectory import canonical_order, load_trajectories
    from rl.train.build import build_trainer, export_weights
    from rl.train.checkpoint import Checkpointer
    from rl.train.loop import resume, sft_loop

    tcfg = cfg.train_sim
    # Collectors write episodes as they finish: the canonical order makes the data stream
    # (and so the trained simulator) the same in every run of the same collection.
    trajs = canonical_order(load_trajectories(tcfg.trajectories))
    train = [t for t in trajs if not is_heldout(t.task_id, tcfg.heldout_fraction)]
    heldout = sorted({t.task_id for t in trajs} - {t.task_id for t in train})
    if rundir.is_writer():  # process 0 of a multi-process job
        (out / rundir.HELDOUT_TASKS).write_text(json.dumps(heldout, indent=1))
    tok = load_tokenizer(cfg.simulator.tokenizer)
    sim_shell = cfg.env.shell.simulated  # the prompt the simulated shell will ask with
    # The prompts the simulated shell will send: over its context, whole oldest turns go.
    prompt = dict(
        system_prompt=sim_shell.system_prompt,
        show_task=sim_shell.show_task,
        context_budget=sim_shell.prompt_budget,
    )
    if sim_shell.workspace:  # the real files after each command, for the simulator to keep
        prompt["workspaces"] = replayed_workspaces(trajs, cfg)
        prompt["named_last"] = sim_shell.workspace_named_last
        prompt["named_absent"] = sim_shell.workspace_named_absent
    ds, stats = sim_sft_dataset(
        weighted_by_kind(train, tcfg.kind_weights), tok, tcfg.data, **prompt
    )
    log = rundir.MetricsLog(out)
    log.write(
        {
            "stage": "train_sim_data",
            "trajectories": len(train),
            "heldout_tasks": len(heldout),
            **stats.to_dict(),
        }
    )
    notes = f" ({stats.cut_targets} observations cut to fit)" if stats.cut_targets else ""
    if sim_shell.workspace and tcfg.data.observation_weight != 1:
        notes += f", observation tokens weighted x{tcfg.data.observation_weight}"
    if sim_shell.workspace and sim_shell.workspace_named_last:
        notes += ", the files each command names listed last"
    if sim_shell.workspace and sim_shell.workspace_named_absent:
        notes += ", the names each command gives that are not there listed"
    if tcfg.data.exit_code_weight != 1:
        notes += f", return codes weighted x{tcfg.data.exit_code_weight}"
    if tcfg.kind_weights:
        notes += " with " + ", ".join(f"{k} x{v}" for k, v in sorted(tcfg.kind_weights.items()))
    print(
        f"simloop train-sim: {len(train)} trajectories ({len(heldout)} tasks held out) -> "
        f"{stats.examples} examples{notes}, {stats.target_tokens} target tokens",
        flush=True,
    )
    device_ids = trainer_device_ids(cfg, "simulator")
    check_trainer_memory(role_model(cfg.simulator), device_ids, "the simulator trainer")
    trainer = build_trainer(
        cfg.simulator,
        tok,
        optim=tcfg.optim,
        steps=tcfg.steps,
        loss="sft",
        rules=cfg.sharding.rules,
        seed=cfg.run.seed,
        device_ids=device_ids,
    )
    batches = iter(ds)
    on_log = None
    if tcfg.eval_every:
        held = set(heldout)
        on_log = heldout_curve(
            trainer, [t for t in trajs if t.task_id in held], tok, tcfg, prompt, log
        )
    with Checkpointer(out / rundir.CHECKPOINTS, tcfg.checkpoint) as ckpt:
        if resume(trainer, ckpt, batches) is not None:
            print(f"simloop train-sim: resuming at step {trainer.step_count}", flush=True)
        summary = sft_loop(
            trainer,
            batches,
            steps=tcfg.steps,
            log=log,
            stage="sim_sft",
            log_every=tcfg.log_every,
            ckpt=ckpt,
            ckpt_every=tcfg.checkpoint.every_steps,
            on_log=on_log,
        )
    # With the prompt layout it learnt, which clients must serve it with.
    layout = {PROMPT_LAYOUT_FILE: prompt_layout_record(sim_shell.prompt_layout())}
    path = export_weights(trainer, out, "final", tcfg.checkpoint, extra_files=layout)
    last = summary["last"]
    loss = f"loss {last['loss']:.4f}" if last.get("loss") is not None else "no loss logged"
    if summary["started_at_step"] >= tcfg.steps:
        print(
            f"simloop train-sim: already at step {summary['steps']} of {tcfg.steps}, nothing "
            f"to train (last {loss}) -> {path}"
        )
        return 0
    print(
        f"simloop train-sim: step {summary['steps']} {loss} "
        f"({summary['tokens_per_s']:.0f} target tok/s, {summary['wall_s']:.0f}s) -> {path}"
    )
    return 0


def replayed_workspaces(trajs: list, cfg: SimloopConfig):
    """`SimulatedShellConfig.workspace`: each trajectory's commands run again in real bash
    (`envs.workspace`), for the workspace after every command, or read from the machine's
    replay cache (`replay_cache`); says how long it took."""
    import time

    from envs.workspace import cached_workspaces, replay_cache_path

    began = time.perf_counter()
    states, failed, hits = cached_workspaces(
        trajs, config=cfg.env.shell.local, use_cache=cfg.env.shell.simulated.replay_cache
    )
    note = f", {failed} failed (their trajectories give no examples)" if failed else ""
    if hits:
        note += f"; {hits} read from the replay cache {replay_cache_path()}"
    print(
        f"simloop train-sim: replayed {len(trajs)} trajectories in real bash for their "
        f"workspaces ({time.perf_counter() - began:.0f}s{note})",
        flush=True,
    )
    return states


def weighted_by_kind(trajs: list, weights: dict[str, int] | None) -> list:
    """Each trajectory as many times as `weights` gives its `task_kind` (once when not
    named), in place: the canonical order stays, the dataset's shuffle mixes the copies."""
    if not weights:
        return trajs
    return [t for t in trajs for _ in range(weights.get(str(t.task_kind), 1))]


def heldout_curve(trainer, trajs: list, tok, tcfg, prompt: dict, log):
    """An `sft_loop` hook that scores the held-out trajectories' examples every
    `tcfg.eval_every` steps (greedy exact match by `task_kind`) into `log`."""
    from rl.data.datasets import labelled_sim_examples
    from rl.train.loop import greedy_exact_by_group

    examples, kinds = labelled_sim_examples(
        trajs,
        lambda t: t.task_kind or "all",
        tok,
        max_len=tcfg.data.seq_len + 1,
        **prompt,
    )
    if not examples:
        return None

    def on_log(last: dict) -> None:
        step = int(last["step"])
        if step % tcfg.eval_every and step != tcfg.steps:
            return
        r = greedy_exact_by_group(
            trainer, examples, kinds, batch_size=tcfg.data.batch_size, pad_id=tok.pad_id
        )
        log.write(
            {
                "stage": "sim_sft_eval",
                "step": step,
                "exact": r["exact"],
                **{f"exact_{k}": v for k, v in r["by_group"].items()},
            }
        )
        kinds_text = " ".join(f"{k} {v:.2f}" for k, v in r["by_group"].items())
        print(
            f"simloop train-sim: step {step}: held-out greedy exact {r['exact']:.3f} "
            f"({kinds_text})",
            flush=True,
        )

    return on_log
