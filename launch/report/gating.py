"""The report page of `simloop demo --experiment gating`: the three arms' real-shell success,
what reality cost each, and the gate over time (per operation: live fidelity and its lower
bound, the simulator's share, success in each shell, simulator versions)."""

from __future__ import annotations

import datetime
import html
from collections import defaultdict
from pathlib import Path

from launch.report.charts import bar_chart, line_chart
from launch.report.fidelity import fidelity_section
from launch.report.markup import document, fmt, missing, table
from launch.report.rundir import find, read_json
from rl.data import rundir

ARMS = ("real_only", "ungated", "gated")


def gating_body(run_dir: Path, summary: dict) -> list[str]:
    g = summary.get("gating") or {}
    if not g or "missing" in g:
        why = g.get("missing", "no gating block in summary.json")
        return [f'<p class="missing">The gating experiment is incomplete: {html.escape(why)}.</p>']
    ci = g["ci95"]
    bars = {arm: {"real shell": g[arm]["real"]} for arm in ARMS}
    intervals = {arm: {"real shell": ci[arm]} for arm in ARMS}
    if "warm_start" in g:
        bars = {"warm start": {"real shell": g["warm_start"]["real"]}, **bars}
    rows = []
    for arm in ARMS:
        diff = None if arm == "real_only" else g[f"{arm}_minus_real_only"]
        dci = None if arm == "real_only" else ci[f"{arm}_minus_real_only"]
        rows.append(
            [
                arm,
                g[arm]["real"],
                f"[{ci[arm][0]:.3f}, {ci[arm][1]:.3f}]",
                diff,
                "" if dci is None else f"[{dci[0]:+.3f}, {dci[1]:+.3f}]",
                g[arm]["real_episodes"],
                g[arm]["episodes"],
            ]
        )
    share = g["gated"].get("sim_share_by_family") or {}
    acc = g.get("acceptance") or {}
    out = [
        "<h2>Does the gate make a weak simulator safe to train in?</h2>",
        "<p>From one warm start, RL with equal steps and episodes: in the real shell only, in "
        "the weak simulator (ungated), and gated by live fidelity (each operation's groups go to "
        "the simulator only while the lower bound of its shadow-measured exact match clears "
        "the threshold; the real episodes co-train it). Success is measured in the real shell "
        "on the same held-out tasks and seeds.</p>",
        bar_chart("real-shell success after RL (95% CI)", bars, intervals=intervals),
        table(
            [
                "arm",
                "real-shell success",
                "95% CI",
                "minus real-only",
                "95% CI",
                "real-shell episodes",
                "RL episodes",
            ],
            rows,
        ),
        f"<p>The gated arm ran {fmt(g['gated_real_share'], 2)} of real-only's real-shell "
        "episodes. Simulator share by operation: "
        + ", ".join(f"{html.escape(k)} {v:.2f}" for k, v in share.items())
        + ".</p>",
        "<p>Acceptance: "
        + ", ".join(f"{html.escape(k)}: <b>{fmt(v)}</b>" for k, v in acc.items())
        + "</p>",
        "<h2>The gate over time</h2>",
        *_gate_over_time(g.get("gate_history") or []),
        "<h2>The weak simulator's fidelity (arm c, held out)</h2>",
        _weak_simulator(g.get("weak_simulator") or {}),
        fidelity_section(read_json(find(run_dir, rundir.FIDELITY, ("eval_sim",)))),
    ]
    if not g.get("gate_history"):
        out.append(missing("gate records", "the gated arm's metrics.jsonl"))
    return out


def _weak_simulator(weak: dict) -> str:
    """What the weak simulator was trained on, in a sentence."""
    if not weak:
        return ""
    steps = weak.get("steps")
    what = (
        "the pretrained simulator as it is (no fine-tune)"
        if not steps
        else f"the pretrained simulator fine-tuned for {steps} train-sim steps"
    )
    wrong = weak.get("wrong_ops")
    if wrong:
        what += (
            f" on the collection with {html.escape(', '.join(wrong))} misreported (their "
            f"commands shown printing the input unchanged: "
            f"{weak.get('misreported_turns')} turns rewritten), so it is wrong about "
            "those operations and right about the rest"
        )
    return f"<p>The weak simulator: {what}.</p>"


def _gate_over_time(history: list[dict]) -> list[str]:
    gates = [r for r in history if r.get("stage") == "gate"]
    rounds = [r for r in history if r.get("stage") == "sim_cotrain_round"]
    if not gates:
        return []
    lower, fid, share = defaultdict(list), defaultdict(list), defaultdict(list)
    for r in gates:
        v = r["policy_version"]
        for unit, u in r["units"].items():
            lower[unit].append((v, u["lower"]))
            if u["fidelity"] is not None:
                fid[unit].append((v, u["fidelity"]))
            routed = u["routed_sim"] + u["routed_real"]
            if routed:
                share[unit].append((v, u["routed_sim"] / routed))
    last = gates[-1]["units"]
    rows = [
        [
            unit,
            u["fidelity"],
            u["lower"],
            u["measured"],
            u["sim_share"],
            u["success_sim"],
            u["success_real"],
        ]
        for unit, u in last.items()
    ]
    first: dict[int, int] = {}  # each simulator version: the first policy version it served
    for r in sorted(gates, key=lambda r: r["policy_version"]):
        first.setdefault(r["sim_version"], r["policy_version"])
    changes = [f"v{s} from policy version {p}" for s, p in first.items()]
    out = [
        line_chart(
            "fidelity lower bound by operation (the gate)", dict(lower), xlabel="policy version"
        ),
        line_chart("simulator share of the groups routed", dict(share), xlabel="policy version"),
        line_chart("live fidelity (shadow exact match)", dict(fid), xlabel="policy version"),
        "<p>At the last policy version, per operation:</p>",
        table(
            [
                "operation",
                "fidelity",
                "lower bound",
                "measured",
                "simulator share (run)",
                "success in sim",
                "success in real",
            ],
            rows,
        ),
        "<p>Simulator versions seen by the router: " + html.escape(", ".join(changes)) + "</p>",
    ]
    if rounds:
        out.append(
            table(
                [
                    "co-training round at policy version",
                    "simulator version",
                    "real episodes",
                    "original episodes",
                    "loss",
                    "train s",
                    "publish s",
                ],
                [
                    [
                        r.get("step"),
                        r.get("sim_version"),
                        r.get("real"),
                        r.get("base"),
                        r.get("loss"),
                        r.get("train_s"),
                        r.get("publish_s"),
                    ]
                    for r in rounds
                ],
            )
        )
    return out


def gating_page(run_dir: Path, summary: dict) -> str:
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    walls = summary.get("stages_wall_s") or {}
    wall = ", ".join(f"{k} {v:.0f} s" for k, v in walls.items() if v is not None)
    head = (
        f"<h1>simloop report: the gating experiment</h1><p class='note'>"
        f"{html.escape(str(run_dir.resolve()))} · {stamp} · stage walls: {html.escape(wall)}"
        f" · total {summary.get('wall_s', 0):.0f} s</p>"
    )
    return document("simloop report: gating", head + "".join(gating_body(run_dir, summary)))
