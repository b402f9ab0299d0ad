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
import dataclasses
import hashlib
import json
import os
import sqlite3
import sys
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


REPLAY_FORMAT = 1
"""Bumped when a replay's result could change for the same episode (`snapshot`, the shell's
start-up): a cache entry keyed under another format is never read."""


REPLAY_CACHE_ENV = "SIMLOOP_REPLAY_CACHE"


def replay_cache_path() -> Path:
    """Where replays are cached: `$SIMLOOP_REPLAY_CACHE`, else
    `$XDG_CACHE_HOME/simloop/workspace-replays.sqlite` (`~/.cache/simloop/...`)."""
    if os.environ.get(REPLAY_CACHE_ENV):
        return Path(os.environ[REPLAY_CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "simloop" / "workspace-replays.sqlite"


def open_replay_cache(enabled: bool) -> ReplayCache | None:
    """The machine's replay cache (`replay_cache_path`) when `enabled`, else None."""
    return ReplayCache(replay_cache_path()) if enabled else None


def cached_workspaces(
    trajectories: Sequence, *, config: LocalShellConfig | None, use_cache: bool
) -> tuple[WorkspaceStates, int, int]:
    """`trajectory_workspaces` through the machine's replay cache when `use_cache`
    (`SimulatedShellConfig.replay_cache`): (states, replays failed, episodes read from it)."""
    cache = open_replay_cache(use_cache)
    try:
        states, failed = trajectory_workspaces(trajectories, config=config, cache=cache)
        return states, failed, cache.hits if cache else 0
    finally:
        if cache:
            cache.close()


class ReplayCache:
    """Replayed workspaces by episode, in one SQLite file (`SimulatedShellConfig.replay_cache`):
    train-sim and eval-sim replay the same collections run after run (21,500 episodes took 13
    minutes of bash on 2 cores), and an episode's replay is a function of its starting files,
    its commands, the shell's settings and `REPLAY_FORMAT`, which together are its key. Only
    replays that succeeded are kept. A file that cannot be opened or read as this cache is
    reported and left alone (the replay runs without it); it never stops a job."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser()
        self.hits = 0
        self.stored = 0
        self._db: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, timeout=60)
            db.execute("CREATE TABLE IF NOT EXISTS replays (key TEXT PRIMARY KEY, states TEXT)")
            db.commit()
            self._db = db
        except (OSError, sqlite3.Error) as e:
            self._warn(e)

    def _warn(self, e: Exception) -> None:
        print(
            f"simloop: the replay cache {self.path} is unusable ({e}); replaying without it "
            f"(point ${REPLAY_CACHE_ENV} at another file, or set "
            "env.shell.simulated.replay_cache false)",
            file=sys.stderr,
            flush=True,
        )
        if self._db is not None:
            self._db.close()
        self._db = None

    @staticmethod
    def key(files: dict[str, str], commands: Sequence[str], config, timeout_s: float) -> str:
        shell = dataclasses.asdict(config) if config is not None else None
        blob = json.dumps(
            [REPLAY_FORMAT, MAX_FILE_BYTES, timeout_s, shell, files, list(commands)],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, keys: Sequence[str]) -> dict[str, list[Workspace]]:
        if self._db is None:
            return {}
        found: dict[str, list[Workspace]] = {}
        wanted = sorted(set(keys))
        try:
            for i in range(0, len(wanted), 500):  # SQLite's bound-parameter limit
                part = wanted[i : i + 500]
                marks = ",".join("?" * len(part))
                rows = self._db.execute(
                    f"SELECT key, states FROM replays WHERE key IN ({marks})", part
                )
                found.update((k, json.loads(v)) for k, v in rows)
        except (sqlite3.Error, ValueError) as e:
            self._warn(e)
            return {}
        self.hits += sum(k in found for k in keys)
        return found

    def put(self, entries: dict[str, list[Workspace]]) -> None:
        if self._db is None or not entries:
            return
        try:
            with self._db:
                self._db.executemany(
                    "INSERT OR REPLACE INTO replays VALUES (?, ?)",
                    [(k, json.dumps(v)) for k, v in entries.items()],
                )
            self.stored += len(entries)
        except sqlite3.Error as e:
            self._warn(e)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def trajectory_workspaces(
    trajectories: Sequence,
    *,
    config: LocalShellConfig | None = None,
    concurrency: int = 8,
    cache: ReplayCache | None = None,
    timeout_s: float = 30.0,
) -> tuple[WorkspaceStates, int]:
    """(states of each trajectory, how many replays failed): every distinct trajectory's
    `sim_commands` replayed from its starting files, for `rl.data.datasets`' workspace-mode
    examples (a failed replay's trajectory gives none). With a `cache`, episodes it holds are
    read from it instead, and the new successful replays are added to it."""
    unique = {id(t): t for t in trajectories}
    episodes = [(dict(t.setup_files), sim_commands(t)) for t in unique.values()]
    keys = [ReplayCache.key(f, c, config, timeout_s) for f, c in episodes] if cache else []
    known = cache.get(keys) if cache else {}
    todo = [i for i in range(len(episodes)) if not cache or keys[i] not in known]
    fresh = asyncio.run(
        replay_many(
            [episodes[i] for i in todo], config=config, concurrency=concurrency, timeout_s=timeout_s
        )
    )
    states: list[list[Workspace] | None] = [known.get(k) for k in keys] if cache else []
    states += [None] * (len(episodes) - len(states))
    for i, s in zip(todo, fresh, strict=True):
        states[i] = s
    if cache:
        cache.put({keys[i]: s for i, s in zip(todo, fresh, strict=True) if s is not None})
    by_id = dict(zip(unique, states, strict=True))
    return (lambda traj: by_id.get(id(traj))), sum(s is None for s in states)
