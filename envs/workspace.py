"""The real workspace behind a recorded episode, turn by turn: what a workspace-mode simulator
(`SimulatedShellConfig.workspace`) is trained to keep. `replay_workspaces` runs an episode's
commands again in real bash (`LocalShell`, from the task's starting files) and reads the
working directory after each; `snapshot` is that read.

The states are in `rl.data.sim_format`'s `Workspace` form (path -> text, `dir/` -> "" for an
empty directory), and `workspace_changes(states[k], states[k + 1])` is what the simulator
must write after the k-th command's observation. A replay is real execution at data-building
time only: the simulator itself never runs anything.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

from envs.config import LocalShellConfig
from envs.local import LocalShell
from envs.shell import TaskSetup
from rl.data.datasets import WorkspaceStates, sim_commands
from rl.data.sim_format import Workspace, normalize_workspace

MAX_FILE_BYTES = 16_384
"""A file longer than this is kept as its first bytes and a marker line: a workspace-mode
simulator is for small workspaces (task files, not repositories)."""


def snapshot(root: str | os.PathLike, *, max_file_bytes: int = MAX_FILE_BYTES) -> Workspace:
    """Every regular file under `root` (UTF-8, undecodable bytes replaced) and every empty
    directory; symlinks and special files are left out."""
    base = Path(root)
    out: Workspace = {}
    for folder, dirs, names in os.walk(base, followlinks=False):
        dirs.sort()
        rel = Path(folder).relative_to(base).as_posix()
        prefix = "" if rel == "." else f"{rel}/"
        if not names and not dirs and prefix:
            out[prefix] = ""
        for name in sorted(names):
            p = Path(folder) / name
            if p.is_symlink() or not p.is_file():
                continue
            try:
                data = p.read_bytes()
            except OSError:
                continue
            text = data[:max_file_bytes].decode("utf-8", errors="replace")
            if len(data) > max_file_bytes:
                text += f"\n[... {len(data) - max_file_bytes} more bytes]\n"
            out[prefix + name] = text
    return normalize_workspace(out)


async def replay_workspaces(
    files: dict[str, str],
    commands: Sequence[str],
    *,
    config: LocalShellConfig | None = None,
    timeout_s: float = 30.0,
) -> list[Workspace]:
    """[the workspace at the start, after command 1, ..., after command n]: the commands run
    again in real bash from the starting `files`, each in a fresh `bash -c`."""
    shell = LocalShell(config, TaskSetup(files=dict(files)))
    try:
        await shell.start()
        states = [await asyncio.to_thread(snapshot, shell.workspace)]
        for command in commands:
            await shell.run(command, timeout_s)
            states.append(await asyncio.to_thread(snapshot, shell.workspace))
        return states
    finally:
        await shell.close()


async def replay_many(
    episodes: Sequence[tuple[dict[str, str], Sequence[str]]],
    *,
    config: LocalShellConfig | None = None,
    concurrency: int = 8,
    timeout_s: float = 30.0,
) -> list[list[Workspace] | None]:
    """`replay_workspaces` of each (files, commands) episode, `concurrency` at a time; None
    for an episode whose replay failed (its shell could not start or a command errored)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(files, commands):
        async with gate:
            try:
                return await replay_workspaces(files, commands, config=config, timeout_s=timeout_s)
            except Exception:  # noqa: BLE001 - the caller counts and skips it
                return None

    return list(await asyncio.gather(*(one(f, c) for f, c in episodes)))


def trajectory_workspaces(
    trajectories: Sequence, *, config: LocalShellConfig | None = None, concurrency: int = 8
) -> tuple[WorkspaceStates, int]:
    """(states of each trajectory, how many replays failed): every distinct trajectory's
    `sim_commands` replayed from its starting files, for `rl.data.datasets`' workspace-mode
    examples (a failed replay's trajectory gives none)."""
    unique = {id(t): t for t in trajectories}
    episodes = [(dict(t.setup_files), sim_commands(t)) for t in unique.values()]
    states = asyncio.run(replay_many(episodes, config=config, concurrency=concurrency))
    by_id = dict(zip(unique, states, strict=True))
    return (lambda traj: by_id.get(id(traj))), sum(s is None for s in states)
