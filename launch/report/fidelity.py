"""The report's simulator-fidelity section (arm c, `fidelity.json`), which the demo's page and
the gating experiment's page both show."""

from __future__ import annotations

from launch.report.markup import fmt, missing, table
from rl.data import rundir


def fidelity_section(fid: dict | None) -> str:
    """`fidelity.json` (arm c) as a section: the pairs, hygiene against the real shell, and
    the breakdowns by operation, context length, depth and command."""
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
        ("by_command", "By command", "command"),
    ):
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
    return "".join(out)
