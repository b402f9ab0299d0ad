"""`simloop report RUN_DIR`: one self-contained `report.html` for a run directory.

    simloop report runs/demo

Works on a `simloop demo` directory (stages in `collect/`, `sim/`, `eval_sim/`, `agent/`) and
on the directory of a single job (`train-agent`, `eval-sim`, `train-sim`): every section whose
data exists is written, the others say what would produce them. Plots are inline SVG and the
style is inline CSS: the page loads nothing from the network.
"""

from __future__ import annotations

import argparse
import datetime
import html
import sys
from pathlib import Path

from launch.config.schema import SimloopConfig
from launch.report.charts import bar_chart, line_chart
from launch.report.fidelity import fidelity_section
from launch.report.markup import document, fmt, interval, missing, pre_block, table
from launch.report.rundir import find, read_evals, read_json, read_metrics, trajectories
from launch.report.thesis import stateful_rows
from rl.data import rundir

SAMPLE_EPISODES = 6


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"simloop report: {run_dir} is not a directory", file=sys.stderr)
        return 2
    path = write_report(run_dir)
    print(f"simloop report: -> {path}")
    return 0


def _section_pipeline(summary: dict | None, run_dir: Path) -> str:
    if summary is None:
        return missing(rundir.SUMMARY, "written by `simloop demo`")
    walls = [*summary.get("stages_wall_s", {}).items(), ("total", summary.get("wall_s"))]
    rows = [[name, None if wall is None else f"{wall:.0f}"] for name, wall in walls]
    stages = summary.get("stages", {})
    c, sim, ag = stages.get("collect", {}), stages.get("sim", {}), stages.get("agent", {})
    rl = summary.get("rl", {})
    items = [
        f"collect: {fmt(c.get('episodes'))} scripted episodes in the real shell "
        f"(scripted success {fmt(c.get('success_rate'), 2)})",
        f"train-sim: {fmt(sim.get('steps'))} SFT steps, final loss {fmt(sim.get('loss'))}, "
        f"{fmt(sim.get('heldout_tasks'))} tasks held out",
        f"eval-sim: {fmt(summary['fidelity'].get('observations'))} held-out observations "
        "replayed (arm c)",
        f"train-agent: warm start {fmt(ag.get('warm_start', {}).get('steps'))} steps, then "
        f"{fmt(rl.get('steps'))} RL steps in arm <b>{fmt(rl.get('arm'))}</b> "
        f"(batch reward {fmt(rl.get('reward_first'))} → {fmt(rl.get('reward_last'))})",
    ]
    return (
        "<ul>"
        + "".join(f"<li>{i}</li>" for i in items)
        + "</ul>"
        + table(["stage", "wall (s)"], rows)
    )


def _stateful_acceptance(st: dict) -> str:
    """One `stateful_fidelity` block: its table and its verdicts."""
    verdicts = "".join(
        f"<li>{html.escape(k.replace('_', ' '))}: "
        + ('<span class="ok">yes</span>' if v else '<span class="bad">no</span>')
        + "</li>"
        for k, v in st["acceptance"].items()
    )
    return table(["observations", "n", "exact (masked)", "goal"], stateful_rows(st)) + (
        f"<ul>{verdicts}</ul>"
    )


def _section_stateful(st: dict) -> str:
    """`simloop demo --experiment stateful`: the simulator's acceptance by depth and state
    distance (`launch.report.thesis.stateful_fidelity`), on the held-out episodes of the
    experiment's tasks and, with `demo.wide_heldout_episodes`, on the wider collection."""
    out = (
        '<p class="note">The stateful experiment: every answer depends on files the episode '
        "wrote, and each replay carries the simulator's own workspace.</p>"
        + _stateful_acceptance(st)
    )
    wide = st.get("wide")
    if wide:
        out += (
            '<p class="note">The same simulator on a wider held-out collection '
            f"({int(wide.get('episodes', 0))} scripted episodes: "
            f"{html.escape(' '.join(wide.get('overrides', [])))}), deeper and with state "
            "distance 3+.</p>" + _stateful_acceptance(wide)
        )
    return out


def _section_thesis(summary: dict | None, metrics: list[dict], real_metrics: list[dict]) -> str:
    t = (summary or {}).get("thesis")
    if not t:
        return missing("the deciding experiment", "`simloop demo` with demo.real_rl (default)")
    if "missing" in t:
        why = html.escape(t["missing"])
        return f'<p class="missing">The deciding experiment is incomplete: {why}.</p>'
    ci = t["ci95"]
    bars = {
        "warm start": {"real shell": t["warm_start"]["real"]},
        "RL in the simulator": {"real shell": t["rl_in_sim"]["real"]},
        "RL in the real shell": {"real shell": t["rl_in_real"]["real"]},
    }
    intervals = {
        "warm start": {"real shell": ci["warm_start"]},
        "RL in the simulator": {"real shell": ci["rl_in_sim"]},
        "RL in the real shell": {"real shell": ci["rl_in_real"]},
    }
    rl_sim = [m for m in metrics if m.get("stage") == "rl" and "step" in m]
    rl_real = [m for m in real_metrics if m.get("stage") == "rl" and "step" in m]
    curves = line_chart(
        "RL: batch reward where it trains",
        {
            "in the simulator": _series(rl_sim, "reward_mean"),
            "in the real shell": _series(rl_real, "reward_mean"),
        },
    )
    g = t["gain"]
    rows = [
        ["warm start", t["warm_start"]["real"], ci["warm_start"], "", ""],
        ["RL in the simulator", t["rl_in_sim"]["real"], ci["rl_in_sim"], g["rl_in_sim"],
         ci["gain_rl_in_sim"]],
        ["RL in the real shell", t["rl_in_real"]["real"], ci["rl_in_real"], g["rl_in_real"],
         ci["gain_rl_in_real"]],
    ]  # fmt: skip
    verdicts = "".join(
        f"<li>{html.escape(k.replace('_', ' '))}: "
        + ('<span class="ok">yes</span>' if v else '<span class="bad">no</span>')
        + "</li>"
        for k, v in t.get("acceptance", {}).items()
    )
    return (
        f'<p class="note">One warm-started agent; RL with the same number of episodes '
        f"({fmt(t['rl_in_sim']['episodes'])} in the simulator, {fmt(t['rl_in_real']['episodes'])} "
        f"in the real shell); all three evaluated in the <b>real shell</b> on the same "
        f"{fmt(t.get('eval_tasks'))} held-out tasks with the same sampling seeds "
        f"({fmt(t['eval_episodes'])} episodes each). Intervals: {html.escape(t['ci95_method'])}, "
        "95%.</p>"
        + '<div class="charts">'
        + bar_chart("Real-shell success (95% intervals)", bars, intervals=intervals)
        + curves
        + "</div>"
        + table(
            [
                "policy",
                "real-shell success",
                "95% interval",
                "gain over warm start",
                "95% interval",
            ],
            [[r[0], r[1], interval(r[2]), r[3], interval(r[4])] for r in rows],
        )
        + f"<p>RL in the simulator minus RL in the real shell: {fmt(t['sim_minus_real'])} "
        f"(95% interval {interval(ci['sim_minus_real'])}). In the simulator itself the RL-in-sim "
        f"policy succeeds {fmt(t['rl_in_sim'].get('sim'))}.</p><ul>{verdicts}</ul>"
    )


def _runs(record: dict) -> list[dict]:
    """Every pretraining run behind a simulator, oldest first: `pretrain_sim.json`'s
    `lineage`, then the record itself."""
    return [*(record.get("lineage") or []), record]


def pretrain_curve(record: dict) -> list[dict]:
    """The learning curves of every pretraining run behind a simulator, steps counted from
    the first run's start."""
    points, offset = [], 0
    for run in _runs(record):
        points += [{**r, "step": offset + r["step"]} for r in run.get("curve") or []]
        offset += int(run.get("steps") or 0)
    return points


def _pretraining(pre: dict) -> str:
    """'by <command>: N examples [and D of its drill], S steps, W s' for each pretraining
    run, oldest first."""
    return "; then ".join(
        f"by <code>{html.escape(str(r.get('command')))}</code>: {fmt(r.get('examples'))} "
        f"real-bash examples of a utility grammar"
        + (f" and {fmt(r['drill_examples'])} of its drill" if r.get("drill_examples") else "")
        + f", {fmt(r.get('steps'))} steps, {fmt(r.get('wall_s'), 0)} s"
        for r in _runs(pre)
    )


def _section_simulator(summary: dict | None, sim_metrics: list[dict], pretrain: dict | None) -> str:
    """What the simulator is, and its fidelity learning curves by operation."""
    sim = ((summary or {}).get("fidelity") or {}).get("simulator") or {}
    out = []
    if sim:
        pre = sim.get("pretrained_on") or {}
        ft = sim.get("fine_tuned_on") or {}
        out.append(
            f'<p class="note">The simulator: {fmt(sim.get("params"))} parameters '
            f"({fmt(sim.get('layers'))} layers, width {fmt(sim.get('hidden'))}, "
            f"{fmt(sim.get('heads'))} heads, byte tokens), started from "
            f"<code>{html.escape(str(sim.get('started_from')))}</code>"
            + (f" (pretrained {_pretraining(pre)})" if pre else "")
            + f", then fine-tuned {fmt(sim.get('fine_tune_steps'))} steps on "
            f"{fmt(ft.get('examples'))} examples from the collected real trajectories. Every "
            "simulated observation is written by this model from its context.</p>"
        )
    charts = []
    curve = pretrain_curve(pretrain or {})
    if curve:
        keys = sorted({k for r in curve for k in r if k.startswith("exact_")})
        runs = len(_runs(pretrain or {}))
        title = "Pretraining: held-out greedy exact by kind" + (
            f" ({runs} runs, each scored on its own held-out set)" if runs > 1 else ""
        )
        charts.append(
            line_chart(
                title,
                {k[6:]: _series(curve, k) for k in keys}
                | {"induction": _series(curve, "induction")},
            )
        )
    ev = [m for m in sim_metrics if m.get("stage") == "sim_sft_eval"]
    if ev:
        keys = sorted({k for r in ev for k in r if k.startswith("exact_")})
        charts.append(
            line_chart(
                "Fine-tuning: held-out greedy exact by operation",
                {k[6:]: _series(ev, k) for k in keys},
            )
        )
    if charts:
        out.append('<div class="charts">' + "".join(charts) + "</div>")
    return "".join(out)


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    return [
        (r["step"], r[key]) for r in rows if "step" in r and isinstance(r.get(key), int | float)
    ]


def _section_training(metrics: list[dict], sim_metrics: list[dict]) -> str:
    rl = [m for m in metrics if m.get("stage") == "rl" and "step" in m]
    ws = [m for m in metrics if m.get("stage") == "warm_start" and "loss" in m]
    sim = [m for m in sim_metrics if m.get("stage") == "sim_sft" and "loss" in m]
    charts = [
        line_chart("RL: batch reward (success)", {"reward": _series(rl, "reward_mean")}),
        line_chart("RL: policy loss", {"loss": _series(rl, "loss")}),
        line_chart(
            "RL: sampler/trainer mismatch KL",
            {"k1": _series(rl, "mismatch_kl"), "k3": _series(rl, "mismatch_kl_k3")},
        ),
        line_chart(
            "RL: staleness (versions)",
            {"mean": _series(rl, "staleness_mean"), "max": _series(rl, "staleness_max")},
        ),
        line_chart("Agent warm start: SFT loss", {"loss": _series(ws, "loss")}),
        line_chart("Simulator: SFT loss", {"loss": _series(sim, "loss")}),
    ]
    note = "" if rl else missing("RL steps", "written by `simloop train-agent`")
    return note + '<div class="charts">' + "".join(charts) + "</div>"


def _section_success(evals: dict | None, summary: dict | None) -> str:
    if not evals:
        return missing(rundir.EVAL, "`simloop train-agent` with train_agent.eval.tasks > 0")
    arms = sorted({arm for label in evals.values() for arm in label})
    label = {"real": "real shell", "closed_loop": "simulator"}
    groups = {
        label.get(a, a): {
            k: evals.get(k, {}).get(a, {}).get("success_rate") for k in ("before", "after")
        }
        for a in arms
    }
    rows = []
    for a in arms:
        for k in ("before", "after"):
            r = evals.get(k, {}).get(a)
            if r:
                kinds = ", ".join(f"{n} {v['success_rate']:.2f}" for n, v in r["by_kind"].items())
                rows.append(
                    [label.get(a, a), k, r["version"], r["episodes"], r["success_rate"], kinds]
                )
    gap = (summary or {}).get("transfer_gap", {})
    gap_text = (
        (
            f'<p class="note">Transfer gap (success in the simulator minus success in the '
            f"real shell): before RL {fmt(gap.get('before'))}, after RL "
            f"{fmt(gap.get('after'))}.</p>"
        )
        if gap
        else ""
    )
    listing = table(
        ["shell", "when", "policy version", "episodes", "success", "by operation"], rows
    )
    return (
        bar_chart("Held-out success before and after RL", groups)
        + gap_text
        + listing
        + _trials(evals, arms, label)
        + _actions(evals, arms, label)
    )


def _trials(evals: dict, arms: list[str], label: dict[str, str]) -> str:
    """Multi-trial evaluations: success by trial k, the adaptation delta, turns per trial."""
    rows = []
    for a in arms:
        for k in ("before", "after"):
            t = evals.get(k, {}).get(a, {}).get("trials")
            if t:
                by = ", ".join(f"by trial {i + 1}: {v:.2f}" for i, v in enumerate(t["success_at"]))
                turns = ", ".join(f"{v:.1f}" for v in t.get("turns_per_trial", []))
                rows.append([label.get(a, a), k, by, t["adaptation_delta"], turns])
    if not rows:
        return ""
    return (
        '<h3>Several trials per episode</h3><p class="note">A failed attempt resets the '
        "workspace and tells the agent why (the checker's verdict); the adaptation delta is "
        "success by trial 2 minus success by trial 1.</p>"
        + table(["shell", "when", "success", "adaptation delta", "turns per trial"], rows)
    )


def _actions(evals: dict, arms: list[str], label: dict[str, str], top: int = 10) -> str:
    """What the agent ran (share of commands by program pipeline) in each evaluation."""
    cols = [
        (a, k)
        for a in arms
        for k in ("before", "after")
        if evals.get(k, {}).get(a, {}).get("actions")
    ]
    if not cols:
        return ""
    from rl.orchestrator.evaluate import top_actions

    dists = [evals[k][a]["actions"] for a, k in cols]
    rows = [[cmd] + [d.get(cmd, 0.0) for d in dists] for cmd in top_actions(dists, top)]
    header = ["command (programs)"] + [f"{label.get(a, a)}, {k} RL" for a, k in cols]
    return (
        f'<p class="note">The agent\'s commands in each evaluation (top {top}, share of all '
        "commands it ran).</p>" + table(header, rows)
    )


def _section_tail(metrics: list[dict]) -> str:
    rows = [m for m in metrics if "active_per_turn" in m]
    if not rows:
        return missing("rollout metrics", "written by rollout, collect and train-agent jobs")
    width = max(len(m["active_per_turn"]) for m in rows)
    header = ["job", "arm", "episodes"] + [f"turn {i + 1}" for i in range(width)]
    body = []
    for m in rows:
        active = list(m["active_per_turn"]) + [None] * (width - len(m["active_per_turn"]))
        body.append([m.get("stage", "?"), m.get("arm", "–"), m.get("episodes")] + active)
    return (
        '<p class="note">Episodes still running at each turn index: the tail of a batch '
        "(docs/architecture.md §8, stragglers).</p>" + table(header, body)
    )


def _section_samples(replays: list[dict], agent_real: list[dict], agent_sim: list[dict]) -> str:
    out = []
    if replays:
        out.append(
            '<p class="note">Arm (c): the same command, its real observation and the '
            "simulator's; where the simulator is still wrong first.</p>"
        )
        for traj in replays[:SAMPLE_EPISODES]:
            for turn in traj.get("turns", [])[:2]:
                same = (turn.get("info") or {}).get("exact_masked")
                verdict = (
                    '<span class="ok">match</span>' if same else '<span class="bad">differs</span>'
                )
                out.append(
                    f'<div class="side"><div><h4>command (task {html.escape(traj["task_id"])})'
                    f"</h4>{pre_block(turn.get('command'))}</div><div><h4>real (rc "
                    f"{fmt(turn.get('exit_code'))})</h4>{pre_block(turn.get('observation'))}</div>"
                    f"<div><h4>simulated (rc {fmt(turn.get('sim_exit_code'))}) {verdict}</h4>"
                    f"{pre_block(turn.get('sim_observation'))}</div></div>"
                )
    else:
        out.append(missing("replayed episodes", "`simloop eval-sim` writes trajectories/replay-*"))
    if agent_real or agent_sim:
        out.append("<h3>The trained agent, same tasks, real shell vs simulator</h3>")
        by_task = {t["task_id"]: t for t in agent_sim}
        for real in agent_real[:SAMPLE_EPISODES]:
            sim = by_task.get(real["task_id"])
            cells = [f"<div><h4>task</h4>{pre_block(real.get('instruction'))}</div>"]
            for name, t in (("real shell", real), ("simulator", sim)):
                if t is None:
                    cells.append(f"<div><h4>{name}</h4>{pre_block(None)}</div>")
                    continue
                text = "\n".join(
                    f"$ {u.get('command')}\n{u.get('observation') or ''}"
                    for u in t.get("turns", [])
                )
                cells.append(
                    f"<div><h4>{name}: reward {fmt(t.get('reward'), 1)}</h4>{pre_block(text)}</div>"
                )
            out.append('<div class="side">' + "".join(cells) + "</div>")
    return "".join(out)


def write_report(run_dir: str | Path) -> Path:
    """Write `report.html` into `run_dir` from whatever the run left there; returns its path."""
    run_dir = Path(run_dir)
    summary = read_json(find(run_dir, rundir.SUMMARY, ()))
    if summary and summary.get("experiment") == "gating":
        from launch.report.gating import gating_page

        path = run_dir / rundir.REPORT
        path.write_text(gating_page(run_dir, summary), encoding="utf-8")
        return path
    fid = read_json(find(run_dir, rundir.FIDELITY, ("eval_sim",)))
    agent_dir = run_dir / "agent" if (run_dir / "agent").is_dir() else run_dir
    evals = read_evals(agent_dir)
    metrics = read_metrics(agent_dir / rundir.METRICS)
    sim_metrics = read_metrics(find(run_dir, rundir.METRICS, ("sim",)))
    tail_metrics = metrics + read_metrics(find(run_dir, rundir.METRICS, ("collect",)))
    replays = next(
        (
            r
            for sub in ("", "eval_sim")
            if (r := trajectories(run_dir / sub / rundir.TRAJECTORIES, "replay", 500))
        ),
        [],
    )
    # Where the simulator is still wrong first, then matches.
    replays.sort(
        key=lambda t: all((u.get("info") or {}).get("exact_masked") for u in t.get("turns", [])[:2])
    )
    agent_traj = agent_dir / rundir.TRAJECTORIES
    agent_real = trajectories(agent_traj, "eval-after-real", 200)
    agent_sim = trajectories(agent_traj, "eval-after-closed_loop", 200)
    # One episode per task, in task order, so the two columns show the same tasks.
    agent_real = list({t["task_id"]: t for t in reversed(agent_real)}.values())[::-1]
    real_metrics = read_metrics(run_dir / "agent_real" / rundir.METRICS)
    started = (((summary or {}).get("fidelity") or {}).get("simulator") or {}).get("started_from")
    pretrain = read_json(Path(started) / "pretrain_sim.json") if started else None
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [
        f"<h1>simloop report</h1><p class='note'>{html.escape(str(run_dir.resolve()))} · {stamp}"
        + (
            " · <b>--quick run</b> (CI-sized: the numbers are real but tiny)"
            if summary and summary.get("quick")
            else ""
        )
        + "</p>",
        "<h2>Pipeline</h2>",
        _section_pipeline(summary, run_dir),
        "<h2>The deciding experiment: RL in the simulator vs RL in the real shell</h2>",
        _section_thesis(summary, metrics, real_metrics),
        "<h2>Agent success: real shell vs simulator</h2>",
        _section_success(evals, summary),
        *(
            [
                _trials(
                    {
                        label: {"real": {"trials": rec}}
                        for label, rec in summary["trials"].items()
                        if label in ("before", "after") and rec.get("success_at")
                    },
                    ["real"],
                    {"real": "real shell (stage trials/)"},
                )
            ]
            if summary and summary.get("trials")
            else []
        ),
        "<h2>The simulator</h2>",
        _section_simulator(summary, sim_metrics, pretrain),
        "<h2>Simulator fidelity (arm c)</h2>",
        *([_section_stateful(summary["stateful"])] if summary and summary.get("stateful") else []),
        fidelity_section(fid),
        "<h2>Training curves</h2>",
        _section_training(metrics, sim_metrics),
        "<h2>Active episodes per turn</h2>",
        _section_tail(tail_metrics),
        "<h2>Sample episodes side by side</h2>",
        _section_samples(replays, agent_real, agent_sim),
    ]
    path = run_dir / rundir.REPORT
    path.write_text(document("simloop report", "".join(body)), encoding="utf-8")
    return path
