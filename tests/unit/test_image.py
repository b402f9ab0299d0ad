"""The image and `make` install one requirement set: the project, through constraints.txt.

Read statically (no docker daemon here, so the image is never built in CI): the Dockerfile
installs the project with its `[tpu]` extra on Python 3.12 through the constraints file the
Makefile's two installs use, and runs `simloop`; every dependency in pyproject.toml has one
exact pin on each side of the file (Python 3.11, the CPU machines; 3.12, the image) that meets
its declared range; this venv holds the CPU side's versions; the GKE configs' image is the one
docs/tpu-gke.md builds from the Dockerfile. Each check returns its problems, and the last tests
show that each one finds a drifted copy.
"""

import importlib.util
import json
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
CONSTRAINTS = "constraints.txt"
GKE_CONFIGS = sorted((REPO / "configs").glob("gke-*.yaml"))
CPU_PYTHON, IMAGE_PYTHON = "3.11", "3.12"
SHELL_BREAKS = {"&&", "||", ";", "|"}


def environment(python: str) -> dict[str, str]:
    """Marker environment of x86_64 Linux CPython `python` (the CPU machines or the image)."""
    env = default_environment()
    env.update(python_version=python, python_full_version=f"{python}.0", sys_platform="linux")
    env.update(platform_system="Linux", platform_machine="x86_64", os_name="posix")
    return env


# ----- reading the files ---------------------------------------------------------------------


def pip_installs(command: str) -> list[dict]:
    """Each `pip install` in a shell command: its constraint files and its requirements, each
    `(path or name, extras, editable)`."""
    words, found = shlex.split(command, comments=True), []
    segments, segment = [], []
    for w in words + ["&&"]:
        if w in SHELL_BREAKS:
            segments.append(segment)
            segment = []
        else:
            segment.append(w)
    for seg in segments:
        at = next(
            (i for i in range(1, len(seg)) if seg[i] == "install" and "pip" in seg[i - 1]), None
        )
        if at is None:
            continue
        install = {"constraints": [], "requirements": []}
        args = iter(seg[at + 1 :])
        for w in args:
            if w in ("-c", "--constraint"):
                install["constraints"].append(next(args))
            elif w in ("-e", "--editable"):
                install["requirements"].append((*_requirement(next(args)), True))
            elif not w.startswith("-"):
                install["requirements"].append((*_requirement(w), False))
        found.append(install)
    return found


def _requirement(spec: str) -> tuple[str, frozenset[str]]:
    m = re.fullmatch(r"([^\[\]]+)(?:\[([^\]]*)\])?", spec)
    assert m, f"not a requirement: {spec!r}"
    return m.group(1), frozenset(e.strip() for e in (m.group(2) or "").split(",") if e.strip())


def makefile(text: str) -> tuple[dict[str, str], dict[str, tuple[list[str], list[str]]]]:
    """(variables, {target: (prerequisites, recipe lines)}), every `$(VAR)` expanded."""
    variables, rules, target = {}, {}, None
    for line in text.splitlines():
        if line.startswith("\t") and target is not None:
            rules[target][1].append(line.strip())
            continue
        target = None
        if m := re.fullmatch(r"([A-Za-z_]+)\s*[:?]?=\s*(.*)", line):
            variables[m.group(1)] = m.group(2).strip()
        elif m := re.fullmatch(r"([^\s#:=][^:=]*):(?!=)(.*)", line):
            target = m.group(1).strip()
            rules[target] = (m.group(2).replace("|", " ").split(), [])

    def expand(s: str) -> str:
        while m := re.search(r"\$\((\w+)\)", s):
            s = s[: m.start()] + variables.get(m.group(1), "") + s[m.end() :]
        return s

    variables = {k: expand(v) for k, v in variables.items()}
    return variables, {
        expand(t): ([expand(p) for p in pre], [expand(r) for r in recipe])
        for t, (pre, recipe) in rules.items()
    }


def dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip())
        for ln in joined.splitlines()
        if ln.strip()
    ]


def pins(text: str, python: str) -> dict[str, list[Requirement]]:
    """{canonical name: [its pins]} of the constraint lines whose marker holds on `python`."""
    found: dict[str, list[Requirement]] = {}
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(environment(python)):
                found.setdefault(canonicalize_name(req.name), []).append(req)
    return found


# ----- the checks ----------------------------------------------------------------------------


def make_problems(text: str) -> list[str]:
    """Both stamps install the project through CONSTRAINTS and are rebuilt when it changes."""
    variables, rules = makefile(text)
    problems = []
    for stamp, extras in ((variables.get("STAMP"), {"test"}), (variables.get("BASE_STAMP"), set())):
        if stamp not in rules:
            problems.append(f"no rule for the stamp {stamp!r}")
            continue
        prerequisites, recipe = rules[stamp]
        if CONSTRAINTS not in prerequisites:
            problems.append(f"{stamp} is not rebuilt when {CONSTRAINTS} changes: {prerequisites}")
        project = [
            i
            for r in recipe
            for i in pip_installs(r)
            if (".", frozenset(extras), True) in i["requirements"]
        ]
        if len(project) != 1 or project[0]["constraints"] != [CONSTRAINTS]:
            problems.append(
                f"{stamp}: want one `pip install -c {CONSTRAINTS} -e .{sorted(extras)}`"
            )
    return problems


def image_problems(text: str) -> list[str]:
    """Python 3.12, the packaged project copied in, `.[tpu]` installed through CONSTRAINTS (and
    nothing installed around it), `simloop` as the entry point."""
    steps = dockerfile(text)
    problems = []
    bases = [args for op, args in steps if op == "FROM"]
    if len(bases) != 1 or not re.fullmatch(r"python:3\.12(-[\w.-]+)?", bases[0]):
        problems.append(f"want one python:3.12 base, got {bases}")
    copied = {src for op, args in steps if op == "COPY" for src in args.split()[:-1]}
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    wanted = {"pyproject.toml", CONSTRAINTS} | {
        p.rstrip("*") for p in packages["packages"]["find"]["include"]
    }
    if wanted - copied:
        problems.append(f"not copied into the image: {sorted(wanted - copied)}")
    installs = [i for op, args in steps if op == "RUN" for i in pip_installs(args)]
    if [i["constraints"] for i in installs] != [[CONSTRAINTS]] or installs[0]["requirements"] != [
        (".", frozenset({"tpu"}), False)
    ]:
        problems.append(f"want exactly one `pip install -c {CONSTRAINTS} '.[tpu]'`: {installs}")
    entry = [json.loads(args) for op, args in steps if op == "ENTRYPOINT"]
    if entry != [["simloop"]]:
        problems.append(f'want ENTRYPOINT ["simloop"], got {entry}')
    return problems


def pin_problems(text: str) -> list[str]:
    """One `==` pin per package and Python, and each dependency pinned within its declared range
    on both sides; the image side also pins the [tpu] extra's stack."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    direct = [Requirement(r) for r in project["dependencies"]]
    tpu = [Requirement(r) for r in project["optional-dependencies"]["tpu"]]
    tpu += [Requirement("libtpu"), Requirement("tpu-inference")]  # what jax[tpu], vllm-tpu pull in
    problems = []
    for python, wanted in ((CPU_PYTHON, direct), (IMAGE_PYTHON, direct + tpu)):
        exact = {}
        for name, reqs in pins(text, python).items():
            specs = [list(r.specifier) for r in reqs]
            if len(reqs) != 1 or len(specs[0]) != 1 or specs[0][0].operator != "==":
                problems.append(f"Python {python}: {name} is not one exact pin: {reqs}")
            elif "*" in specs[0][0].version:
                problems.append(f"Python {python}: {name} is a wildcard: {reqs[0]}")
            else:
                exact[name] = Version(specs[0][0].version)
        for req in wanted:
            if req.marker is not None and not req.marker.evaluate(environment(python)):
                continue
            name = canonicalize_name(req.name)
            if name not in exact:
                problems.append(f"Python {python}: {req.name} has no exact pin")
            elif not req.specifier.contains(exact[name], prereleases=True):
                problems.append(f"Python {python}: {name}=={exact[name]} is outside {req}")
    return problems


def read(name: str) -> str:
    return (REPO / name).read_text()


# ----- the real files ------------------------------------------------------------------------


def test_the_makefile_installs_the_project_through_the_constraints():
    assert make_problems(read("Makefile")) == []


def test_the_dockerfile_installs_the_tpu_extra_through_the_same_constraints():
    assert image_problems(read("Dockerfile")) == []


def test_every_dependency_has_one_exact_pin_on_each_side():
    assert pin_problems(read(CONSTRAINTS)) == []


def test_this_venv_holds_the_pinned_versions():
    """`make` installed this venv through the file, so every pin that applies here is what is
    installed, and everything simloop's runtime pulls in is pinned."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    have = pins(read(CONSTRAINTS), python)
    if python not in (CPU_PYTHON, IMAGE_PYTHON):
        pytest.skip(f"the file pins Python {CPU_PYTHON} and {IMAGE_PYTHON}, not {python}")
    refresh = _refresh_module()
    closure = refresh.runtime_closure()
    assert set(closure) - set(have) == set(), "runtime packages without a pin: `make constraints`"
    wrong = {
        n: (v, str(have[n][0])) for n, v in closure.items() if str(have[n][0].specifier) != f"=={v}"
    }
    assert wrong == {}, "installed != pinned: `make` reinstalls when constraints.txt changes"


def test_the_gke_image_is_built_from_the_dockerfile_in_the_docs():
    doc, header = read("docs/tpu-gke.md"), read("Dockerfile")
    assert "(../Dockerfile)" in doc and "(../constraints.txt)" in doc
    images = {yaml.safe_load(p.read_text())["gke"]["image"] for p in GKE_CONFIGS}
    assert images, "no GKE config names an image"
    for image in images:
        build = f"docker build --platform linux/amd64 -t {image} ."
        for text in (doc, header):
            assert build in text and f"docker push {image}" in text, image


def test_the_refresh_writes_a_file_that_pins_each_side_its_own_versions():
    refresh = _refresh_module()
    cpu = {"jax": "0.10.2", "flax": "0.12.8", "numpy": "2.4.6"}
    image = {"jax": "0.10.2", "flax": "0.12.4", "numpy": "2.3.5", "libtpu": "0.0.42.1"}
    image |= {"torch": "2.10.0", "nvidia-nccl-cu12": "2.27.5", "triton": "3.6.0"}
    text = refresh.render(cpu, image, "0.25.0")
    for python, want in ((CPU_PYTHON, cpu), (IMAGE_PYTHON, image)):
        got = {n: str(r[0].specifier)[2:] for n, r in pins(text, python).items()}
        assert got == {n: v for n, v in want.items() if not refresh.left_to_torch(n)}
    assert "\njax==0.10.2\n" in text  # shared: once, no marker
    assert refresh.read_pins(text)["libtpu"] == "0.0.42.1"


# ----- each check finds a drifted copy -------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "$(BIN)/python -m pip install -q --no-compile -c $(CONSTRAINTS) -e .\n",
            "$(BIN)/python -m pip install -q --no-compile -e .\n",
        ),
        ("-c $(CONSTRAINTS) -e '.[test]'", "-e '.[test]'"),
        ("$(BASE_STAMP): pyproject.toml $(CONSTRAINTS)", "$(BASE_STAMP): pyproject.toml"),
        ("CONSTRAINTS := constraints.txt", "CONSTRAINTS := requirements/pins.txt"),
    ],
)
def test_make_problems_catches(old, new):
    text = read("Makefile")
    assert old in text
    assert make_problems(text.replace(old, new))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("FROM python:3.12-slim-bookworm", "FROM python:3.11-slim-bookworm"),
        ("-c constraints.txt '.[tpu]'", "'.[tpu]'"),
        ("-c constraints.txt '.[tpu]'", "-c constraints.txt ."),
        ("COPY launch launch\n", ""),
        ('ENTRYPOINT ["simloop"]', 'ENTRYPOINT ["python", "-m", "launch"]'),
        ("&& simloop --help", "&& pip install -q wandb && simloop --help"),
    ],
)
def test_image_problems_catches(old, new):
    text = read("Dockerfile")
    assert old in text
    assert image_problems(text.replace(old, new))


def _drift(text: str, name: str, python: str, to: str | None) -> str:
    """`text` with the lines pinning `name` on `python` rewritten as `name<to>` (their marker
    kept), or dropped when `to` is None."""
    out = []
    for line in text.splitlines(keepends=True):
        spec = line.split("#")[0].strip()
        req = Requirement(spec) if spec else None
        if (
            req is None
            or canonicalize_name(req.name) != name
            or (req.marker is not None and not req.marker.evaluate(environment(python)))
        ):
            out.append(line)
        elif to is not None:
            out.append(f"{name}{to}" + (f" ; {req.marker}" if req.marker else "") + "\n")
    assert "".join(out) != text, f"nothing pins {name} on Python {python}"
    return "".join(out)


@pytest.mark.parametrize(
    ("name", "python", "to", "found"),
    [
        ("jax", CPU_PYTHON, "==0.*", "3.11: jax is a wildcard"),
        ("jax", IMAGE_PYTHON, "==0.6.2", "3.12: jax==0.6.2 is outside jax>=0.7"),
        ("numpy", CPU_PYTHON, ">=1.26", "3.11: numpy is not one exact pin"),
        ("flax", IMAGE_PYTHON, None, "3.12: flax has no exact pin"),
        ("vllm-tpu", IMAGE_PYTHON, None, "3.12: vllm-tpu has no exact pin"),
        ("libtpu", IMAGE_PYTHON, None, "3.12: libtpu has no exact pin"),
    ],
)
def test_pin_problems_catches(name, python, to, found):
    problems = pin_problems(_drift(read(CONSTRAINTS), name, python, to))
    assert any(found in p for p in problems), problems


def test_pin_problems_catches_two_pins_for_one_package():
    text = read(CONSTRAINTS) + "tenacity==8.0.0\n"
    problems = pin_problems(text)
    assert any("3.11: tenacity is not one exact pin" in p for p in problems), problems
    assert any("3.12: tenacity is not one exact pin" in p for p in problems), problems


def _refresh_module():
    spec = importlib.util.spec_from_file_location(
        "dev_constraints", REPO / "dev" / "constraints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
