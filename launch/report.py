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
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launch.schema import SimloopConfig
from launch.train import read_evals

REPORT_FILE = "report.html"
SAMPLE_EPISODES = 6
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def run(args: argparse.Namespace, cfg: SimloopConfig) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"simloop report: {run_dir} is not a directory", file=sys.stderr)
        return 2
    path = write_report(run_dir)
    print(f"simloop report: -> {path}")
    return 0


# ----- reading a run directory ------------------------------------------------------------------


def _find(run_dir: Path, name: str, subdirs: Sequence[str]) -> Path | None:
    for sub in ("", *subdirs):
        p = run_dir / sub / name
        if p.exists():
            return p
    return None


def _json(path: Path | None) -> Any:
    return json.loads(path.read_text()) if path is not None else None


def read_metrics(path: Path | None) -> list[dict]:
    """The records of a `metrics.jsonl` ([] when absent; a line cut by a crash is skipped)."""
    if path is None or not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a crash: the rest is still worth reporting
    return out


def _trajectories(directory: Path | None, prefix: str, limit: int) -> list[dict]:
    if directory is None or not directory.is_dir():
        return []
    out: list[dict] = []
    for path in sorted(directory.glob(f"{prefix}*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
                if len(out) >= limit:
                    return out
    return out


# ----- SVG charts -------------------------------------------------------------------------------


def _nice(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def line_chart(
    title: str,
    series: dict[str, list[tuple[float, float]]],
    *,
    xlabel: str = "step",
    width: int = 460,
    height: int = 240,
) -> str:
    """An inline SVG line chart of one or more (x, y) series, with axes, min/max ticks and a
    legend; an empty chart says there is no data."""
    esc = html.escape
    pts = [p for s in series.values() for p in s if p[1] is not None]
    left, right, top, bottom = 56, 12, 28, 36
    w, h = width - left - right, height - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{esc(title)}" class="chart">',
             f'<text x="{width / 2}" y="16" text-anchor="middle" class="ct">'
             f"{esc(title)}</text>"]  # fmt: skip
    if not pts:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" text-anchor="middle">no data</text>')
        return "".join(parts) + "</svg>"
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.1 or 1), y1 + (abs(y1) * 0.1 or 1)

    def sx(x):
        return left + (x - x0) / (x1 - x0) * w

    def sy(y):
        return top + h - (y - y0) / (y1 - y0) * h

    parts.append(f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>')
    for y in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
                     f'class="grid"/><text x="{left - 4}" y="{sy(y) + 4:.1f}" '
                     f'text-anchor="end">{_nice(y)}</text>')  # fmt: skip
    for x in (x0, x1):
        parts.append(f'<text x="{sx(x):.1f}" y="{top + h + 14}" text-anchor="middle">'
                     f"{_nice(x)}</text>")  # fmt: skip
    parts.append(f'<text x="{left + w / 2}" y="{height - 4}" text-anchor="middle">'
                 f"{esc(xlabel)}</text>")  # fmt: skip
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        s = [(x, y) for x, y in s if y is not None]
        if not s:
            continue
        d = " ".join(
            f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(s)
        )
        parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        if len(s) <= 40:
            parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"/>'
                      for x, y in s]  # fmt: skip
        ly = top + 12 + 14 * i
        parts.append(f'<rect x="{left + 8}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{left + 22}" y="{ly - 3}">{esc(name)}</text>')  # fmt: skip
    return "".join(parts) + "</svg>"


def bar_chart(title: str, groups: dict[str, dict[str, float | None]], *, width: int = 460,
              height: int = 240) -> str:  # fmt: skip
    """Grouped bars in [0, 1] (e.g. success by arm, before and after): {group: {bar: value}}."""
    esc = html.escape
    left, top, bottom = 40, 28, 40
    w, h = width - left - 12, height - top - bottom
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'role="img" aria-label="{esc(title)}" class="chart">',
             f'<text x="{width / 2}" y="16" text-anchor="middle" class="ct">{esc(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{w}" height="{h}" class="frame"/>']  # fmt: skip
    for y in (0.0, 0.5, 1.0):
        yy = top + h - y * h
        parts.append(f'<line x1="{left}" x2="{left + w}" y1="{yy}" y2="{yy}" class="grid"/>'
                     f'<text x="{left - 4}" y="{yy + 4}" text-anchor="end">'
                     f"{y:g}</text>")  # fmt: skip
    names = list(groups)
    bars = sorted({b for g in groups.values() for b in g}, key=lambda b: (b != "before", b))
    gw = w / max(len(names), 1)
    bw = gw * 0.7 / max(len(bars), 1)
    for gi, name in enumerate(names):
        gx = left + gi * gw + gw * 0.15
        for bi, bar in enumerate(bars):
            v = groups[name].get(bar)
            if v is None:
                continue
            bh = max(0.0, min(1.0, v)) * h
            x = gx + bi * bw
            parts.append(f'<rect x="{x:.1f}" y="{top + h - bh:.1f}" width="{bw - 2:.1f}" '
                         f'height="{bh:.1f}" fill="{PALETTE[bi % len(PALETTE)]}"/>'
                         f'<text x="{x + bw / 2 - 1:.1f}" y="{top + h - bh - 3:.1f}" '
                         f'text-anchor="middle" class="small">{v:.2f}</text>')  # fmt: skip
        parts.append(f'<text x="{left + gi * gw + gw / 2:.1f}" y="{top + h + 14}" '
                     f'text-anchor="middle">{esc(name)}</text>')  # fmt: skip
    for bi, bar in enumerate(bars):
        parts.append(f'<rect x="{left + 8 + 90 * bi}" y="{height - 12}" width="10" height="8" '
                     f'fill="{PALETTE[bi % len(PALETTE)]}"/><text x="{left + 22 + 90 * bi}" '
                     f'y="{height - 4}">{esc(bar)}</text>')  # fmt: skip
    return "".join(parts) + "</svg>"


# ----- HTML -------------------------------------------------------------------------------------

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1100px;color:#222;line-height:1.45;padding:0 16px}
h1{margin-bottom:4px} h2{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:32px}
table{border-collapse:collapse;margin:8px 0 16px} td,th{border:1px solid #ddd;padding:4px 8px;
text-align:right;font-variant-numeric:tabular-nums} th{background:#f5f5f5}
td:first-child,th:first-child{text-align:left}
.chart{margin:6px 12px 6px 0;font-size:11px;font-family:inherit} .chart .ct{font-size:13px;
font-weight:600} .chart .frame{fill:none;stroke:#999} .chart .grid{stroke:#eee}
.chart .small{font-size:10px} .charts{display:flex;flex-wrap:wrap}
.note{color:#555;font-size:14px} .missing{color:#a33}
pre{background:#f7f7f7;border:1px solid #e3e3e3;padding:6px;margin:0;white-space:pre-wrap;
word-break:break-all;font-size:12px;max-height:220px;overflow:auto}
.side{display:grid;grid-template-columns:1fr 1fr 1fr;gap:8px;margin:10px 0 18px}
.side h4{margin:0 0 4px;font-size:13px} .ok{color:#1a7f37} .bad{color:#b42318}
"""


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_f(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _missing(what: str, how: str) -> str:
    return (
        f'<p class="missing">No {html.escape(what)} in this run directory ({html.escape(how)}).</p>'
    )


def _pre(text: str | None) -> str:
    return f"<pre>{html.escape(text if text is not None else '(none)')}</pre>"


def _section_pipeline(summary: dict | None, run_dir: Path) -> str:
    if summary is None:
        return _missing("summary.json", "written by `simloop demo`")
    walls = [*summary.get("stages_wall_s", {}).items(), ("total", summary.get("wall_s"))]
    rows = [[name, None if wall is None else f"{wall:.0f}"] for name, wall in walls]
    stages = summary.get("stages", {})
    c, sim, ag = stages.get("collect", {}), stages.get("sim", {}), stages.get("agent", {})
    rl = summary.get("rl", {})
    items = [
        f"collect: {_f(c.get('episodes'))} scripted episodes in the real shell "
        f"(scripted success {_f(c.get('success_rate'), 2)})",
        f"train-sim: {_f(sim.get('steps'))} SFT steps, final loss {_f(sim.get('loss'))}, "
        f"{_f(sim.get('heldout_tasks'))} tasks held out",
        f"eval-sim: {_f(summary['fidelity'].get('observations'))} held-out observations "
        "replayed (arm c)",
        f"train-agent: warm start {_f(ag.get('warm_start', {}).get('steps'))} steps, then "
        f"{_f(rl.get('steps'))} RL steps in arm <b>{_f(rl.get('arm'))}</b> "
        f"(batch reward {_f(rl.get('reward_first'))} → {_f(rl.get('reward_last'))})",
    ]
    return ("<ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul>"
            + _table(["stage", "wall (s)"], rows))  # fmt: skip


def _section_fidelity(fid: dict | None) -> str:
    if fid is None:
        return _missing(
            "fidelity.json", "written by `simloop eval-sim` / the demo's eval_sim stage"
        )
    p, h, r = fid["pairs"], fid["hygiene"], fid["real_hygiene"]
    out = [
        f'<p class="note">{_f(p.get("count"))} simulated observations of held-out real commands '
        "(the real session so far in the prompt), each compared with the real one. "
        "Masked: timestamps, PIDs, addresses and temp names replaced before comparing.</p>",
        _table(
            ["exact", "exact (masked)", "return-code agreement", "similarity", "length ratio"],
            [
                [
                    p.get("exact"),
                    p.get("exact_masked"),
                    p.get("exit_code_agreement"),
                    p.get("similarity"),
                    p.get("length_ratio_geomean"),
                ]
            ],
        ),  # fmt: skip
        "<h3>Hygiene (rates)</h3>",
    ]
    names = ["cap_hit", "think_leak", "repetition", "empty", "malformed"]
    out.append(_table([""] + [n.replace("_", " ") for n in names],
                      [["simulated"] + [h.get(n) for n in names],
                       ["real"] + [r.get(n) for n in names]]))  # fmt: skip
    for key, title, first in (("by_context", "By context length (prompt tokens)", "prompt tokens"),
                              ("by_command", "By command", "command")):  # fmt: skip
        out.append(f"<h3>{title}</h3>")
        rows = [[k, v.get("count"), v.get("exact_masked"), v.get("exit_code_agreement"),
                 v.get("similarity")] for k, v in fid.get(key, {}).items()]  # fmt: skip
        out.append(_table([first, "observations", "exact (masked)", "return code", "similarity"],
                          rows))  # fmt: skip
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
        ),  # fmt: skip
        line_chart(
            "RL: staleness (versions)",
            {"mean": _series(rl, "staleness_mean"), "max": _series(rl, "staleness_max")},
        ),  # fmt: skip
        line_chart("Agent warm start: SFT loss", {"loss": _series(ws, "loss")}),
        line_chart("Simulator: SFT loss", {"loss": _series(sim, "loss")}),
    ]
    note = "" if rl else _missing("RL steps", "written by `simloop train-agent`")
    return note + '<div class="charts">' + "".join(charts) + "</div>"


def _section_success(evals: dict | None, summary: dict | None) -> str:
    if not evals:
        return _missing("eval.json", "`simloop train-agent` with train_agent.eval.tasks > 0")
    arms = sorted({arm for label in evals.values() for arm in label})
    label = {"real": "real shell", "closed_loop": "simulator"}
    groups = {label.get(a, a): {k: evals.get(k, {}).get(a, {}).get("success_rate")
                                for k in ("before", "after")} for a in arms}  # fmt: skip
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
    gap_text = (f'<p class="note">Transfer gap (success in the simulator minus success in the '
                f"real shell): before RL {_f(gap.get('before'))}, after RL "
                f"{_f(gap.get('after'))}.</p>") if gap else ""  # fmt: skip
    return (bar_chart("Held-out success before and after RL", groups) + gap_text
            + _table(["shell", "when", "policy version", "episodes", "success", "by operation"],
                     rows) + _actions(evals, arms, label))  # fmt: skip


def _actions(evals: dict, arms: list[str], label: dict[str, str], top: int = 10) -> str:
    """What the agent ran (share of commands by program pipeline) in each evaluation."""
    cols = [(a, k) for a in arms for k in ("before", "after")
            if evals.get(k, {}).get(a, {}).get("actions")]  # fmt: skip
    if not cols:
        return ""
    from rl.orchestrator.evaluate import top_actions

    dists = [evals[k][a]["actions"] for a, k in cols]
    rows = [[cmd] + [d.get(cmd, 0.0) for d in dists] for cmd in top_actions(dists, top)]
    header = ["command (programs)"] + [f"{label.get(a, a)}, {k} RL" for a, k in cols]
    return (f'<p class="note">The agent\'s commands in each evaluation (top {top}, share of all '
            "commands it ran).</p>" + _table(header, rows))  # fmt: skip


def _section_tail(metrics: list[dict]) -> str:
    rows = [m for m in metrics if "active_per_turn" in m]
    if not rows:
        return _missing("rollout metrics", "written by rollout, collect and train-agent jobs")
    width = max(len(m["active_per_turn"]) for m in rows)
    header = ["job", "arm", "episodes"] + [f"turn {i + 1}" for i in range(width)]
    body = []
    for m in rows:
        active = list(m["active_per_turn"]) + [None] * (width - len(m["active_per_turn"]))
        body.append([m.get("stage", "?"), m.get("arm", "–"), m.get("episodes")] + active)
    return ('<p class="note">Episodes still running at each turn index: the tail of a batch '
            "(DESIGN §8, stragglers).</p>" + _table(header, body))  # fmt: skip


def _section_samples(replays: list[dict], agent_real: list[dict], agent_sim: list[dict]) -> str:
    out = []
    if replays:
        out.append('<p class="note">Arm (c): the same command, its real observation and the '
                   "simulator's.</p>")  # fmt: skip
        for traj in replays[:SAMPLE_EPISODES]:
            for turn in traj.get("turns", [])[:2]:
                same = (turn.get("info") or {}).get("exact_masked")
                verdict = ('<span class="ok">match</span>' if same
                           else '<span class="bad">differs</span>')  # fmt: skip
                out.append(
                    f'<div class="side"><div><h4>command (task {html.escape(traj["task_id"])})'
                    f"</h4>{_pre(turn.get('command'))}</div><div><h4>real (rc "
                    f"{_f(turn.get('exit_code'))})</h4>{_pre(turn.get('observation'))}</div>"
                    f"<div><h4>simulated (rc {_f(turn.get('sim_exit_code'))}) {verdict}</h4>"
                    f"{_pre(turn.get('sim_observation'))}</div></div>"
                )
    else:
        out.append(_missing("replayed episodes", "`simloop eval-sim` writes trajectories/replay-*"))
    if agent_real or agent_sim:
        out.append("<h3>The trained agent, same tasks, real shell vs simulator</h3>")
        by_task = {t["task_id"]: t for t in agent_sim}
        for real in agent_real[:SAMPLE_EPISODES]:
            sim = by_task.get(real["task_id"])
            cells = [f"<div><h4>task</h4>{_pre(real.get('instruction'))}</div>"]
            for name, t in (("real shell", real), ("simulator", sim)):
                if t is None:
                    cells.append(f"<div><h4>{name}</h4>{_pre(None)}</div>")
                    continue
                text = "\n".join(f"$ {u.get('command')}\n{u.get('observation') or ''}"
                                 for u in t.get("turns", []))  # fmt: skip
                cells.append(f"<div><h4>{name}: reward {_f(t.get('reward'), 1)}</h4>"
                             f"{_pre(text)}</div>")  # fmt: skip
            out.append('<div class="side">' + "".join(cells) + "</div>")
    return "".join(out)


def write_report(run_dir: str | Path) -> Path:
    """Write `report.html` into `run_dir` from whatever the run left there; returns its path."""
    run_dir = Path(run_dir)
    summary = _json(_find(run_dir, "summary.json", ()))
    fid = _json(_find(run_dir, "fidelity.json", ("eval_sim",)))
    agent_dir = run_dir / "agent" if (run_dir / "agent").is_dir() else run_dir
    evals = read_evals(agent_dir)
    metrics = read_metrics(agent_dir / "metrics.jsonl")
    sim_metrics = read_metrics(_find(run_dir, "metrics.jsonl", ("sim",)))
    tail_metrics = metrics + read_metrics(_find(run_dir, "metrics.jsonl", ("collect",)))
    replays = next((r for sub in ("", "eval_sim")
                    if (r := _trajectories(run_dir / sub / "trajectories", "replay",
                                           SAMPLE_EPISODES))), [])  # fmt: skip
    agent_traj = agent_dir / "trajectories"
    agent_real = _trajectories(agent_traj, "eval-after-real", 200)
    agent_sim = _trajectories(agent_traj, "eval-after-closed_loop", 200)
    # One episode per task, in task order, so the two columns show the same tasks.
    agent_real = list({t["task_id"]: t for t in reversed(agent_real)}.values())[::-1]
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    body = [
        f"<h1>simloop report</h1><p class='note'>{html.escape(str(run_dir.resolve()))} · {stamp}"
        + (" · <b>--quick run</b> (CI-sized: the numbers are real but tiny)"
           if summary and summary.get("quick") else "") + "</p>",  # fmt: skip
        "<h2>Pipeline</h2>", _section_pipeline(summary, run_dir),
        "<h2>Agent success: real shell vs simulator</h2>", _section_success(evals, summary),
        "<h2>Simulator fidelity (arm c)</h2>", _section_fidelity(fid),
        "<h2>Training curves</h2>", _section_training(metrics, sim_metrics),
        "<h2>Active episodes per turn</h2>", _section_tail(tail_metrics),
        "<h2>Sample episodes side by side</h2>", _section_samples(replays, agent_real, agent_sim),
    ]  # fmt: skip
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<title>simloop report</title><style>" + CSS + "</style></head><body>"
        + "".join(body) + "</body></html>"
    )  # fmt: skip
    path = run_dir / REPORT_FILE
    path.write_text(page, encoding="utf-8")
    return path
