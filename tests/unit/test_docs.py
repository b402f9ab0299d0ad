"""The docs stay true to the repository: relative links resolve (anchors too), every
`simloop ...` command in a bash block names a real subcommand whose `--help` works and whose
config overrides validate, no module cites a doc file the repository lacks, and the README
stays a front door (at most 250 lines)."""

import os
import re
import shlex
from pathlib import Path

import pytest

from launch.cli import SUBCOMMANDS, build_parser, main
from launch.config.loading import ConfigError, load_config
from launch.config.schema import SimloopConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        REPO / "README.md",
        REPO / "CONTRIBUTING.md",
        REPO / "bench" / "README.md",
        REPO / "dev" / "LOG.md",
        REPO / "configs" / "pretrained" / "README.md",
    ]
    + list((REPO / "docs").rglob("*.md"))
)
# dev/LOG.md is a dated log: its commands are history, not promises, so only its links count.
COMMAND_DOCS = [p for p in DOCS if p.name != "LOG.md"]
README_MAX_LINES = 250

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
SHELL_BREAKS = {"&&", "||", "|", ";"}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(h) for h in HEADING.findall(text)}


def _links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text()))


def _commands(path: Path) -> list[list[str]]:
    """The words after `simloop` of every command line in the file's bash blocks
    (continuation lines joined, comments dropped, cut at the first shell operator)."""
    found = []
    for lang, block in FENCE.findall(path.read_text()):
        if lang.strip() not in ("bash", "sh", "shell"):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            starts = [i for i, w in enumerate(words) if w == "simloop" or w.endswith("/simloop")]
            if not starts:
                continue
            argv = []
            for w in words[starts[0] + 1 :]:
                if w in SHELL_BREAKS or w.startswith(">"):
                    break
                argv.append(w)
            found.append(argv)
    return found


def test_the_docs_exist():
    missing = [str(p.relative_to(REPO)) for p in DOCS if not p.is_file()]
    assert not missing, f"doc pages missing: {missing}"
    assert (REPO / "docs" / "architecture.md").is_file()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no {dest})")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    assert not broken, f"{doc.relative_to(REPO)}: broken links: {broken}"


def _all_commands() -> list[tuple[Path, list[str]]]:
    return [(doc, argv) for doc in COMMAND_DOCS for argv in _commands(doc)]


def test_the_docs_show_commands():
    subs = {argv[0] for _, argv in _all_commands() if argv}
    # the README tours the pipeline; a doc set that lost its commands fails here
    assert {"demo", "train-agent", "serve", "rehearse", "gke"} <= subs, subs


def test_every_shown_subcommand_exists_and_its_help_works(capsys):
    subs = sorted({argv[0] for _, argv in _all_commands() if argv})
    unknown = [s for s in subs if not s.startswith("-") and s not in SUBCOMMANDS]
    assert not unknown, f"the docs show subcommands the CLI lacks: {unknown}"
    for sub in [s for s in subs if s in SUBCOMMANDS] + ["--help"]:
        argv = [sub] if sub == "--help" else [sub, "--help"]
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0, f"simloop {' '.join(argv)} exited {exit_.value.code}"
        assert "usage: simloop" in capsys.readouterr().out


def test_every_shown_command_parses_and_its_overrides_validate():
    parser = build_parser()
    failures = []
    for doc, argv in _all_commands():
        if not argv or argv[0].startswith("-"):
            continue
        shown = f"{doc.relative_to(REPO)}: simloop {' '.join(argv)}"
        if argv[0] == "tpu-vm" and "--" in argv:  # the remote command is not ours to parse
            argv = argv[: argv.index("--")]
        try:
            args, rest = parser.parse_known_args(argv)
        except SystemExit:
            failures.append(f"{shown}: the parser refused it")
            continue
        config = args.config
        if config is not None and not (REPO / config).is_file():
            continue  # a run's own config.yaml, made by an earlier command
        if any("$" in w for w in rest):
            continue
        if args.command == "serve":
            from launch.jobs.serve import flag_overrides

            rest = flag_overrides(args) + rest
        try:
            load_config(SimloopConfig, str(REPO / config) if config else None, rest)
        except (ConfigError, ValueError) as e:
            failures.append(f"{shown}: {e}")
    assert not failures, "\n".join(failures)


DOC_CITATION = re.compile(r"([\w./-]*\b[\w-]+\.md)\b")
SECTION_CITATION = re.compile(r"docs/architecture\.md §(\d+(?:\.\d+)?)")


def _python_files() -> list[Path]:
    skip = {".venv", "runs", "build", ".git", "node_modules", "__pycache__"}
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith(".egg-info")]
        found += [Path(root) / f for f in files if f.endswith(".py")]
    return [p for p in found if p != Path(__file__).resolve()]


def test_no_module_cites_a_doc_the_repository_lacks():
    sections = set(re.findall(r"^## §(\d+)", (REPO / "docs/architecture.md").read_text(), re.M))
    sections |= set(
        re.findall(r"^### §(\d+\.\d+)", (REPO / "docs/architecture.md").read_text(), re.M)
    )
    bad = []
    for py in _python_files():
        text = py.read_text(errors="replace")
        rel = py.relative_to(REPO)
        if re.search(r"\bDESIGN\b", text):
            bad.append(f"{rel}: cites DESIGN, which the repository lacks")
        for cited in DOC_CITATION.findall(text):
            if cited.startswith(("http", "www.")) or cited in ("SKILL.md",):
                continue
            candidates = [REPO / cited, py.parent / cited]
            if not any(c.is_file() for c in candidates):
                bad.append(f"{rel}: cites {cited}, which the repository lacks")
        for section in SECTION_CITATION.findall(text):
            if section not in sections:
                bad.append(
                    f"{rel}: cites docs/architecture.md §{section}, which has no such section"
                )
    assert not bad, "\n".join(bad)


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    fences = FENCE.findall("\n".join(lines) + "\n")
    assert fences, "README.md shows no commands"
    first = [line.split("#")[0].split() for line in fences[0][1].splitlines()]
    assert [w for w in first if w][:2] == [["make", "demo"], ["make", "test"]], (
        "the README's first commands are `make demo` and `make test`"
    )
