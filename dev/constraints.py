"""Rewrites constraints.txt, the exact versions that `make` and the Dockerfile install.

    make constraints          # installs uv into .venv, then runs:
    .venv/bin/python dev/constraints.py --uv .venv/bin/uv [--vllm-tpu VERSION]

One file, two resolutions:

- the CPU side (Python 3.11: `make`, CI): simloop's runtime closure exactly as it is installed
  in the interpreter that runs this script (the venv `make` built), so the pins are what the
  test suite ran against;
- the image side (Python 3.12: the Dockerfile): `simloop[tpu]` resolved by uv for Python 3.12
  on x86_64 Linux with glibc 2.36 (the python:3.12-slim-bookworm base), `vllm-tpu` held at one
  version and the CPU side's versions preferred, so the two differ only where the TPU stack pins
  otherwise (tpu-inference pins jax, flax and libtpu exactly; numba caps numpy).

A pin both sides share is written once, without a marker; the others carry `python_version`
markers. Newer releases: upgrade the venv first (`.venv/bin/python -m pip install -U -e
'.[test]'`, which ignores the constraints), then run this; `--vllm-tpu` moves the image's vLLM.
pip cannot resolve for a Python it is not running under (it evaluates markers against its
own), hence uv for the image side.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "constraints.txt"
CPU = 'python_version < "3.12"'
IMAGE = 'python_version >= "3.12"'
IMAGE_PLATFORM = "x86_64-manylinux_2_36"
RESOLVE_TIMEOUT_S = 900
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;]+)\s*(?:;\s*(.+))?$")


def left_to_torch(name: str) -> bool:
    """torch and what its wheel pins exactly (triton, CUDA libraries) stay out of the file: the
    image gets them through tpu-inference's exact `torchvision==` pin, and pinning them here
    would clash on Python 3.12 with the test extra's own `torch==`."""
    return name in ("torch", "triton") or name.startswith(("nvidia-", "cuda-"))


def runtime_closure(project: str = "simloop") -> dict[str, str]:
    """{name: installed version} of what `project`'s runtime requirements pull in here,
    extras followed, markers evaluated for this interpreter; test extras are not followed."""
    found: dict[str, tuple[str, set[str]]] = {}
    todo: list[tuple[str, frozenset[str]]] = [(project, frozenset())]
    while todo:
        name, extras = todo.pop()
        dist = md.distribution(name)
        key = canonicalize_name(name)
        had = found.get(key, ("", set()))[1]
        if key in found and extras <= had:
            continue
        found[key] = (dist.version, had | extras)
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = ("", *extras)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted):
                todo.append((req.name, frozenset(req.extras)))
    found.pop(canonicalize_name(project))
    return {name: version for name, (version, _) in found.items()}


def read_pins(text: str) -> dict[str, str]:
    """{canonical name: version} of the `name==version` lines (markers and extras ignored)."""
    pins = {}
    for line in text.splitlines():
        m = PIN.match(line.split("#")[0].strip())
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def image_closure(uv: str, vllm_tpu: str, prefer: dict[str, str]) -> dict[str, str]:
    """{name: version} of `simloop[tpu]` resolved by uv for the image (Python 3.12 on x86_64
    Linux), with `vllm-tpu==vllm_tpu` and `prefer`'s versions wherever they fit."""
    with tempfile.TemporaryDirectory() as tmp:
        req, pins, out = Path(tmp, "in.txt"), Path(tmp, "pins.txt"), Path(tmp, "out.txt")
        req.write_text(f"simloop[tpu] @ {REPO.as_uri()}\n")
        pins.write_text(f"vllm-tpu=={vllm_tpu}\n")
        # an existing output file is uv's set of preferred versions
        out.write_text("".join(f"{n}=={v}\n" for n, v in sorted(prefer.items())))
        argv = [uv, "pip", "compile", "--no-config", "--quiet", "--no-header", "--no-annotate"]
        argv += ["--python-version", "3.12", "--python-platform", IMAGE_PLATFORM]
        argv += ["--constraints", str(pins), "--output-file", str(out), str(req)]
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        subprocess.run(argv, check=True, env=env, timeout=RESOLVE_TIMEOUT_S)
        resolved = read_pins(out.read_text())
    resolved.pop("simloop", None)
    return resolved


def render(cpu: dict[str, str], image: dict[str, str], vllm_tpu: str) -> str:
    """The file: pins both sides share, then the CPU side's own, then the image's own."""
    both = sorted(n for n in cpu if image.get(n) == cpu[n])
    cpu_only = sorted(n for n in cpu if n not in both)
    image_only = sorted(n for n in image if n not in both and not left_to_torch(n))
    lines = [
        "# The exact versions simloop installs: `make` (Python 3.11: the CPU machines, CI) and the",
        "# Dockerfile (Python 3.12: the TPU image) both run `pip install -c constraints.txt`.",
        '# Generated by dev/constraints.py (`make constraints`); docs/tpu-gke.md, "The image".',
        "# Do not edit by hand: regenerate, and review the diff.",
        "#",
        "# Unmarked: simloop's runtime dependencies at the versions both sides install.",
        f"# `{CPU}`: the CPU side's runtime closure where the image's differs",
        "#   (test-only packages stay unpinned: the test extra's ranges apply).",
        f"# `{IMAGE}`: the image's `simloop[tpu]` closure (vllm-tpu {vllm_tpu}, tpu-inference,",
        "#   libtpu) resolved for x86_64 Linux, glibc 2.36; torch, triton and the CUDA wheels",
        "#   follow tpu-inference's exact torchvision pin and are not listed.",
        "",
        "# --- both sides",
        *(f"{n}=={cpu[n]}" for n in both),
        "",
        "# --- the CPU side (make, CI)",
        *(f"{n}=={cpu[n]} ; {CPU}" for n in cpu_only),
        "",
        "# --- the image (Dockerfile)",
        *(f"{n}=={image[n]} ; {IMAGE}" for n in image_only),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--uv", default="uv", help="the uv executable that resolves the image side")
    p.add_argument("--vllm-tpu", help="the image's vllm-tpu version (default: the file's)")
    p.add_argument("--output", type=Path, default=OUTPUT)
    args = p.parse_args(argv)
    if sys.version_info[:2] >= (3, 12):
        p.error("run it with the CPU side's Python (3.11, the venv `make` built)")
    old = args.output.read_text() if args.output.is_file() else ""
    vllm_tpu = args.vllm_tpu or read_pins(old).get("vllm-tpu")
    if not vllm_tpu:
        p.error(f"{args.output} pins no vllm-tpu: name one with --vllm-tpu")
    cpu = runtime_closure()
    image = image_closure(args.uv, vllm_tpu, cpu)
    args.output.write_text(render(cpu, image, vllm_tpu))
    print(f"{args.output}: {len(cpu)} CPU-side pins, {len(image)} image-side (vllm-tpu {vllm_tpu})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
