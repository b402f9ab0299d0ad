"""The report's simulator-fidelity section (arm c, `fidelity.json`), which the demo's page and
the gating experiment's page both show."""

from __future__ import annotations

from launch.report.charts import line_chart
from launch.report.markup import fmt, missing, table
from rl.data import rundir


def fidelity_section(fid: dict | None) -> str:
    """`fidelity.json` (arm c) as a section: the pairs, hygiene against the real shell, and
    the breakdowns by operation, context length, depth, state distance and command, and the
    curves by depth and by state distance."""
    if fid is None:
        return missing(rundir.FIDELITY, "written by `simloop eval-sim` / the demo's eval_sim stage")
    p, h, r = fid["pairs"], fid["hygiene"], fid["real_hygiene"]
    out = [
        f'<p class="note">{fmt(p.get("count"))} simulated observations of held-out real commands '
        "(the real session so far in the prompt), each compared with the real one. "
        "Masked: timestamps, PIDs, addresses and temp names replaced before comparing.</p>",
        table(
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
        ),
        "<h3>Hygiene (rates)</h3>",
    ]
    names = ["cap_hit", "think_leak", "repetition", "empty", "malformed"]
    out.append(
        table(
            [""] + [n.replace("_", " ") for n in names],
            [["simulated"] + [h.get(n) for n in names], ["real"] + [r.get(n) for n in names]],
        )
    )
    for key, title, first in (
        ("by_kind", "By operation (the replayed task's)", "operation"),
        ("by_context", "By context length (prompt tokens)", "prompt tokens"),
        ("by_depth", "By depth (turns before the command)", "turns"),
        ("by_state_distance", "By state distance (turns since the file it reads was written)",
         "turns"),
        ("by_command", "By command", "command"),
    ):  # fmt: skip
        out.append(f"<h3>{title}</h3>")
        rows = [
            [
                k,
                v.get("count"),
                v.get("exact_masked"),
                v.get("exit_code_agreement"),
                v.get("similarity"),
            ]
            for k, v in fid.get(key, {}).items()
        ]
        out.append(
            table([first, "observations", "exact (masked)", "return code", "similarity"], rows)
        )
    dep = fid.get("state_dependent") or {}
    out.append(
        f'<p class="note">{fmt(dep.get("count"))} observations ({fmt(dep.get("share"))} of '
        "them) read a file the episode itself wrote; at a state distance of 3 turns or more, "
        f"exact (masked) {fmt((fid.get('state_distance_3plus') or {}).get('exact_masked'))}.</p>"
    )
    out.append(fidelity_curves(fid))
    return "".join(out)


def _bucket_start(name: str) -> float:
    return float(name.split("-")[0])


def fidelity_curves(fid: dict) -> str:
    """Exact (masked) by turn depth and by state distance, as line charts over each bucket's
    lower bound."""
    charts = []
    for key, title, xlabel in (
        ("by_depth", "Exact (masked) by depth", "turns before the command (bucket start)"),
        ("by_state_distance", "Exact (masked) by state distance",
         "turns since the file it reads was written (bucket start)"),
    ):  # fmt: skip
        series = {
            "exact (masked)": [
                (_bucket_start(k), v.get("exact_masked")) for k, v in fid.get(key, {}).items()
            ],
            "return code": [
                (_bucket_start(k), v.get("exit_code_agreement"))
                for k, v in fid.get(key, {}).items()
            ],
        }
        charts.append(line_chart(title, series, xlabel=xlabel))
    return '<div class="charts">' + "".join(charts) + "</div>"
