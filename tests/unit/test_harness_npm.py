"""npm harnesses (`harness.kind: claude-code`): the pinned package is installed once into the
cache, readable by the sandbox's user, and a missing npm or an unreachable registry is a clear
`NpmUnavailable`, never a traceback."""

from __future__ import annotations

import os
import stat

import pytest

from rl.orchestrator import harness as h
from rl.orchestrator.harness import HarnessConfig, NpmUnavailable, claude_command


def fake_npm(tmp_path, body: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    npm = bin_dir / "npm"
    npm.write_text("#!/bin/sh\n" + body)
    npm.chmod(0o755)
    return bin_dir


def test_installs_once_into_a_folder_the_sandbox_can_read(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    # `npm install --prefix DIR ...`: record the call, then install a `claude` executable
    bin_dir = fake_npm(
        tmp_path,
        f'echo "$@" >> {calls}\nmkdir -p "$3/node_modules/.bin"\n'
        'printf "#!/bin/sh\\necho 2.1.328\\n" > "$3/node_modules/.bin/claude"\n'
        'chmod 755 "$3/node_modules/.bin/claude"\n',
    )
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    cfg = HarnessConfig(kind="claude-code", npm_cache=str(tmp_path / "cache"))
    exe = h.install_npm_harness(cfg)
    assert exe == h.npm_root(cfg) / "node_modules" / ".bin" / "claude" and exe.exists()
    assert "@anthropic-ai/claude-code@2.1.328" in calls.read_text()
    assert stat.S_IMODE(h.npm_root(cfg).stat().st_mode) == 0o755
    assert h.install_npm_harness(cfg) == exe
    assert len(calls.read_text().splitlines()) == 1  # cached: npm not run again
    assert h.launchers(cfg) == [str(exe)]


def test_no_npm_and_an_unreachable_registry_say_so(tmp_path, monkeypatch):
    cfg = HarnessConfig(kind="claude-code", npm_cache=str(tmp_path / "cache"))
    monkeypatch.setattr(h.shutil, "which", lambda name: None)
    with pytest.raises(NpmUnavailable, match="not on PATH: install Node.js"):
        h.install_npm_harness(cfg)
    monkeypatch.undo()
    bin_dir = fake_npm(tmp_path, 'echo "npm error code ENOTFOUND registry.npmjs.org" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(NpmUnavailable, match=r"exit 1; is the npm registry reachable.*ENOTFOUND"):
        h.install_npm_harness(cfg)
    assert not h.npm_root(cfg).exists()  # nothing half-installed is left to be mistaken
    assert list((tmp_path / "cache").iterdir()) == []


def test_the_command_points_claude_code_at_the_middleware_and_keeps_it_quiet():
    cfg = HarnessConfig(kind="claude-code", step_limit=3, max_tokens=64)
    cmd = claude_command(cfg, "/c/claude", "http://127.0.0.1:9/", "rollout-1")
    for part in (
        "ANTHROPIC_BASE_URL=http://127.0.0.1:9 ",
        "ANTHROPIC_API_KEY=rollout-1 ",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS=64 ",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 ",
        "/c/claude -p ",
        "--output-format json --max-turns 3 --permission-mode bypassPermissions",
    ):
        assert part in cmd, (part, cmd)
