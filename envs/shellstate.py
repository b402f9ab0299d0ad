"""Which files a shell command reads and writes, read off its text, and from that each turn's
*state distance*: the turns since the episode last wrote a file the command reads. Fidelity
by state distance (`rl.orchestrator.evaluate.replay_fidelity`) asks whether a simulator keeps
the workspace it was shown changing: an observation at distance 1 depends on the command
just before, one at distance 5 on a write five turns back, and one with no distance depends
only on the task's starting files (or on nothing).

This is a reading of common shell, not a shell: redirections (`>`, `>>`, `<`, `2>`), `tee`,
`touch`, `mkdir`, `cp`, `mv`, `rm`, `sed -i`, and the file arguments of the usual readers
(`cat`, `head`, `tail`, `wc`, `sort`, `grep`, `ls`, ...; option values and bare numbers are
not files; `tr` reads only stdin). A command it cannot split is read as
touching nothing. A directory and the files under it are the same state (`ls archive` reads
what `mv x archive/` wrote).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence

_SPLIT = re.compile(r"&&|\|\||[;|\n]")
READERS = frozenset(
    "cat head tail wc sort tac grep egrep fgrep uniq cut paste rev fold awk sed diff ls "
    "less more nl od xxd md5sum sha256sum stat file find du cmp comm join split".split()
)
"""Programs whose non-option arguments are files they read (the first of grep / sed / awk is
their pattern or script, not a file)."""
_PATTERN_FIRST = frozenset({"grep", "egrep", "fgrep", "sed", "awk"})
_IGNORED = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "-"})
_VALUED = frozenset({"-n", "-c", "-d", "-f", "-k", "-t", "-w", "-e", "-m", "-s", "-o"})
"""Options whose value is the next word (`head -n 2`, `cut -d , -f 1`): not a file."""


def _norm(path: str) -> str | None:
    path = path.strip().removeprefix("./").rstrip("/")
    if not path or path in _IGNORED or "$" in path or "`" in path:
        return None
    return path


def command_files(command: str) -> tuple[set[str], set[str]]:
    """(files and directories `command` reads, those it writes), as written in it."""
    reads: set[str] = set()
    writes: set[str] = set()
    for stage in _SPLIT.split(command or ""):
        try:
            words = shlex.split(stage, comments=True)
        except ValueError:
            continue
        args: list[str] = []
        i = 0
        while i < len(words):
            w = words[i]
            m = re.fullmatch(r"(\d?)(>>?|<)(.*)", w)
            if m:
                target = m.group(3) or (words[i + 1] if i + 1 < len(words) else "")
                i += 1 if m.group(3) else 2
                path = _norm(target.lstrip("&"))
                if path and not target.startswith("&"):
                    (reads if m.group(2) == "<" else writes).add(path)
                continue
            args.append(w)
            i += 1
        while args and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", args[0]):
            args = args[1:]  # VAR=value prefixes
        if not args:
            continue
        prog, rest = args[0].split("/")[-1], args[1:]
        files = [
            a
            for j, a in enumerate(rest)
            if not a.startswith("-") and not (j and rest[j - 1] in _VALUED) and not a.isdigit()
        ]
        paths = [p for p in (_norm(f) for f in files) if p]
        if prog in ("touch", "mkdir", "rm", "rmdir"):
            writes.update(paths)
        elif prog == "tee":
            writes.update(paths)
        elif prog in ("cp", "mv") and len(paths) >= 2:
            reads.update(paths[:-1])
            writes.add(paths[-1])
            if prog == "mv":
                writes.update(paths[:-1])  # gone from where they were
        elif prog == "sed" and any(a.startswith("-i") for a in rest):
            targets = paths[1:]
            reads.update(targets)
            writes.update(targets)
        elif prog in READERS:
            reads.update(paths[1:] if prog in _PATTERN_FIRST else paths)
    return reads, writes


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def state_distances(commands: Sequence[str | None]) -> list[int | None]:
    """For each command of an episode, the turns since the latest earlier command that wrote
    a file it reads (1: the one just before), or None when it reads nothing the episode
    wrote."""
    effects = [command_files(c or "") for c in commands]
    out: list[int | None] = []
    for t, (reads, _) in enumerate(effects):
        found = None
        for s in range(t - 1, -1, -1):
            if any(_overlaps(r, w) for r in reads for w in effects[s][1]):
                found = t - s
                break
        out.append(found)
    return out
