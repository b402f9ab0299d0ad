"""Where the test suite's CPU time goes: `SIMLOOP_TEST_CPU=FILE make test` (tests/conftest.py)
appends one line per test (node id, CPU seconds of the pytest process, CPU seconds of the
processes it started and reaped, wall seconds, the xdist worker, the Unix time it ended); this
sums them by test file, largest first, and says how long each worker was busy and how long it
sat idle at the end while the other finished (the suite's tail).

    python -m tests.cpu_report FILE [--top N]
"""

from __future__ import annotations

import argparse
import resource
from pathlib import Path

CPU_REPORT_ENV = "SIMLOOP_TEST_CPU"


def cpu_seconds() -> tuple[float, float]:
    """(this process's user + system seconds, those of its reaped descendants)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def read_lines(path: Path) -> list[list[str]]:
    """The file's lines split into fields: 6 (node, own CPU, children's CPU, wall, worker, end
    time) or 4 (the first four: files written before the last two were added)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split("\t")
        if len(parts) not in (4, 6):
            raise ValueError(
                f"{path}:{n}: expected 6 (or 4) tab-separated fields, got {len(parts)}"
            )
        out.append(parts)
    return out


def by_worker(path: Path) -> dict[str, tuple[float, float, float]]:
    """xdist worker -> (seconds busy in tests, seconds from its first test's start to its last
    test's end, seconds it finished before the last worker did). Empty for a 4-field file."""
    spans: dict[str, list[float]] = {}
    for parts in read_lines(path):
        if len(parts) != 6:
            return {}
        wall, worker, end = float(parts[3]), parts[4], float(parts[5])
        span = spans.setdefault(worker, [0.0, end - wall, end])
        span[0] += wall
        span[1] = min(span[1], end - wall)
        span[2] = max(span[2], end)
    last = max((s[2] for s in spans.values()), default=0.0)
    return {w: (busy, end - start, last - end) for w, (busy, start, end) in sorted(spans.items())}


def by_file(path: Path) -> list[tuple[str, float, float, int]]:
    """(file, CPU seconds, wall seconds, tests) per test file, most CPU first."""
    rows: dict[str, list[float]] = {}
    for node, own, children, wall, *_ in read_lines(path):
        row = rows.setdefault(node.split("::")[0], [0.0, 0.0, 0])
        row[0] += float(own) + float(children)
        row[1] += float(wall)
        row[2] += 1
    return sorted(((f, c, w, int(k)) for f, (c, w, k) in rows.items()), key=lambda r: -r[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    args = parser.parse_args()
    if not args.file.is_file():
        parser.error(f"{args.file} is not a file: run the suite with {CPU_REPORT_ENV}=FILE first")
    try:
        rows = by_file(args.file)
    except ValueError as e:
        parser.error(str(e))
    if not rows:
        parser.error(f"{args.file} holds no tests")
    total = sum(r[1] for r in rows)
    print(f"{'CPU s':>8} {'share':>6} {'wall s':>8} {'tests':>5}  file")
    for name, cpu, wall, tests in rows[: args.top]:
        print(f"{cpu:8.1f} {cpu / total:6.1%} {wall:8.1f} {tests:5d}  {name}")
    print(
        f"{total:8.1f} CPU seconds over {sum(r[3] for r in rows)} tests "
        f"(on 2 cores at best {total / 2 / 60:.1f} minutes of wall time)"
    )
    for worker, (busy, span, idle_end) in by_worker(args.file).items():
        print(
            f"worker {worker}: in tests {busy:.0f} s of its {span:.0f} s; "
            f"done {idle_end:.0f} s before the last worker"
        )


if __name__ == "__main__":
    main()
