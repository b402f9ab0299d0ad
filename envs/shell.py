"""The `Shell` protocol every backend implements (local, E2B, simulated), its `Observation`,
task setup, and output capping with middle truncation.

Commands run the way mini-swe-agent runs them: each in a fresh `bash -c` in the episode's
working directory, so state persists only through the filesystem.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

TIMEOUT_EXIT_CODE = 124
"""Exit code reported for a command killed at its timeout (as GNU `timeout` does)."""


@dataclass(frozen=True)
class Observation:
    """What one command produced."""

    output: str
    """stdout and stderr (merged where the backend allows), capped with middle truncation."""
    exit_code: int
    """The command's exit status; 128+N when killed by signal N; 124 on timeout."""
    truncated: bool = False
    """The middle of the output was cut (or the simulator hit its token cap)."""
    duration_s: float = 0.0
    """Wall-clock time the command took."""
    info: dict[str, Any] = field(default_factory=dict)
    """Backend details: timeout reason, isolation used, pathology flags of the simulator."""


class ShellError(RuntimeError):
    """The shell itself failed (not the command): sandbox gone, simulator unreachable."""


class ShellLifecycle:
    """The async-context-manager plumbing every backend shares: entering starts the shell,
    leaving closes it (on every exit path). Backends implement `start` and `close`."""

    async def start(self) -> None:
        """Acquire what the shell needs (workspace, sandbox); default: nothing."""

    async def close(self) -> None:  # pragma: no cover - every backend overrides it
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class TaskSetupError(ShellError):
    """A task setup command failed; the episode cannot start."""


@dataclass(frozen=True)
class TaskSetup:
    """What a shell prepares before the first command: files (relative to the working
    directory), then commands run in order (each must exit 0)."""

    files: Mapping[str, str] = field(default_factory=dict)
    commands: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.files, Mapping):
            raise ValueError(f"TaskSetup.files={self.files!r} is invalid: a mapping path -> text")
        for path, text in self.files.items():
            check_relative_path(path, "TaskSetup.files")
            if not isinstance(text, str):
                raise ValueError(f"TaskSetup.files[{path!r}] is invalid: file content as text")
        object.__setattr__(self, "commands", tuple(self.commands))
        for i, cmd in enumerate(self.commands):
            if not isinstance(cmd, str) or not cmd.strip():
                raise ValueError(f"TaskSetup.commands[{i}]={cmd!r} is invalid: a shell command")

    def to_dict(self) -> dict[str, Any]:
        return {"files": dict(self.files), "commands": list(self.commands)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> TaskSetup:
        data = data or {}
        unknown = set(data) - {"files", "commands"}
        if unknown:
            raise ValueError(f"unknown setup key(s) {sorted(unknown)}: allowed files, commands")
        return cls(files=dict(data.get("files") or {}), commands=tuple(data.get("commands") or ()))


def setup_hash(setup: TaskSetup) -> str:
    """A hash of what a task's workspace starts from (its files and setup commands): the
    workspace hash of a shell that cannot look at its files (the simulator)."""
    h = hashlib.sha256(b"setup\0")
    for path in sorted(setup.files):
        h.update(f"{path}\0{len(setup.files[path])}\0{setup.files[path]}\0".encode())
    for cmd in setup.commands:
        h.update(f"cmd\0{cmd}\0".encode())
    return h.hexdigest()


def tree_hash(root: str | os.PathLike) -> str:
    """A hash of a directory's contents: every file's relative path and bytes, every symlink's
    target, every empty directory (not times or owners): equal for identical workspaces."""
    h = hashlib.sha256(b"tree\0")
    base = Path(root)
    for folder, dirs, names in os.walk(base, followlinks=False):
        dirs.sort()  # walk in a fixed order
        rel = Path(folder).relative_to(base).as_posix()
        if not names and not dirs:
            h.update(f"dir\0{rel}\0".encode())
        for name in sorted(names + [d for d in dirs if (Path(folder) / d).is_symlink()]):
            p = Path(folder) / name
            if p.is_symlink():
                h.update(f"link\0{rel}/{name}\0{os.readlink(p)}\0".encode())
                continue
            h.update(f"file\0{rel}/{name}\0".encode())
            if not p.is_file():  # a FIFO or socket: never opened (a read could block)
                h.update(b"special\0")
                continue
            try:
                h.update(hashlib.sha256(p.read_bytes()).digest())
            except OSError as e:  # a file made unreadable: that it is counts
                h.update(f"unreadable\0{type(e).__name__}\0".encode())
    return h.hexdigest()


def check_relative_path(path: str, where: str) -> str:
    """`path` normalised; must stay inside the working directory."""
    norm = posixpath.normpath(path) if isinstance(path, str) and path else ""
    if not norm or norm.startswith(("/", "../")) or norm in (".", ".."):
        raise ValueError(f"{where} path {path!r} is invalid: a relative path inside the workdir")
    return norm


@runtime_checkable
class Shell(Protocol):
    """A place to run an agent's commands. `async with` starts it (task setup) and always
    closes it; `run` may also start it lazily."""

    async def run(self, command: str, timeout_s: float) -> Observation: ...

    async def close(self) -> None: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


def truncation_marker(omitted: int, unit: str = "bytes") -> str:
    return f"\n[... {omitted} {unit} of output truncated ...]\n"


def truncate_middle(text: str, max_chars: int) -> tuple[str, bool]:
    """Keep the first and last halves of `text` when it is longer than `max_chars`."""
    if len(text) <= max_chars:
        return text, False
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - head - tail
    return text[:head] + truncation_marker(omitted, "characters") + text[-tail:], True


class HeadTailBuffer:
    """Keeps the first and last `max_bytes // 2` bytes of a stream in bounded memory, and
    counts the rest, so any amount of output costs at most ~2 x `max_bytes`."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._head_cap = max_bytes // 2
        self._tail_cap = max_bytes - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def write(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            # Trim only when the tail doubles, so trimming is amortised O(1) per byte.
            if len(self._tail) > 2 * self._tail_cap:
                del self._tail[: len(self._tail) - self._tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.max_bytes

    def getvalue(self) -> bytes:
        tail = bytes(self._tail[-self._tail_cap :]) if self._tail_cap else b""
        kept = len(self._head) + len(tail)
        if self.total <= kept:
            return bytes(self._head) + tail
        marker = truncation_marker(self.total - kept).encode()
        return bytes(self._head) + marker + tail


def decode_output(data: bytes) -> tuple[str, bool]:
    """Bytes of a terminal to text: invalid UTF-8 becomes U+FFFD and NUL bytes too (they
    break tokenizers and text tools). Returns (text, looked_binary)."""
    text = data.decode("utf-8", errors="replace")
    nul = "\x00" in text
    if nul:
        text = text.replace("\x00", "\ufffd")
    binary = nul or text.count("\ufffd") > max(8, len(text) // 100)
    return text, binary


def buffered_observation(
    buf: HeadTailBuffer, exit_code: int, started: float, info: dict[str, Any]
) -> Observation:
    """The Observation of captured output: decoded (binary flagged in `info`), truncated as
    the buffer was, timed from `started` (a `time.monotonic()` reading)."""
    import time

    text, binary = decode_output(buf.getvalue())
    if binary:
        info["binary"] = True
    return Observation(
        output=text,
        exit_code=exit_code,
        truncated=buf.truncated,
        duration_s=time.monotonic() - started,
        info=info,
    )
