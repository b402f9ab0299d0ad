"""The `mini-swe-agent` importer: mini-swe-agent's `*.traj.json` -> a simloop `Trajectory`.

The file (written by mini-swe-agent's `DefaultAgent.save`) is an object with
`trajectory_format` (`mini-swe-agent-1` for v1, `mini-swe-agent-1.1` for v2; any
`mini-swe-agent-*` is read), `messages` (OpenAI-style chat messages), `info` (`exit_status`,
`submission`, `model_stats`, `mini_version`, `config`) and, from the SWE-bench runner,
`instance_id`.

- v1: plain `{role, content}` messages. The command is the assistant's one ```bash block (a reply
  with none or several is a format error, answered by a user message); the observation is the
  next user message, `<returncode>N</returncode>\\n<output>\\n...</output>`. The run ends with a
  user message holding the submission (empty after `LimitsExceeded`), which the agent never saw
  as an observation: it is dropped.
- v2: the model's own message plus `extra`. With tool calls (the default) the assistant message
  has `tool_calls` (the `bash` tool, `{"command"}`) and each command's output is a `role: "tool"`
  message with its `tool_call_id`; text-based models use a ```mswea_bash_command block and user
  observations. `extra.actions` lists the commands run, an observation's `extra.raw_output` /
  `extra.returncode` what the command printed, untruncated, and its exit code. A reply that
  failed to parse is not kept, only the user message telling the agent so (`extra.interrupt_type`
  `FormatError`). The run ends with a `role: "exit"` message (`extra.exit_status`,
  `extra.submission`), dropped too.

Status from `info.exit_status` (else the exit message's): `Submitted` -> `ok`; `LimitsExceeded`
and `RepeatedFormatError` -> `truncated`; `TimeExceeded` (the wall-clock limit) -> `timeout`;
`UserInterruption` -> `aborted`; anything else (an exception's class name) -> `error`, with the
exit status (and `info.exception_str`) as the reason. `info.submission` is kept in `meta`.
Messages from the Responses API (items without a `role`) are not supported.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rl.data.importers_common import (
    Item,
    Reader,
    chat_turns,
    enclosed,
    extra_of,
    imported,
    split_prompt,
    task_statement,
)
from rl.data.trajectory import Status, Trajectory

MINI_FORMAT_PREFIX = "mini-swe-agent"
"""`trajectory_format` values this importer reads start with this."""

_STATUS: dict[str, Status] = {
    "Submitted": "ok",
    "LimitsExceeded": "truncated",
    "RepeatedFormatError": "truncated",
    "TimeExceeded": "timeout",
    "UserInterruption": "aborted",
}
_CONSIDER = "Consider the following PR description:"


def _task(text: str) -> str:
    """The task inside mini-swe-agent's instance templates (SWE-bench's `<pr_description>`, the
    CLI's `Please solve this issue: ...`), else the whole message."""
    pr = enclosed(text, "<pr_description>", "</pr_description>")
    if pr is not None:
        pr = pr.strip()
        pr = pr[len(_CONSIDER) :].strip() if pr.startswith(_CONSIDER) else pr
    solve = enclosed(text, "Please solve this issue: ", "\n\nYou can execute bash commands")
    for found in (pr, solve):
        if found is not None and found.strip():
            return found.strip()
    return task_statement(text)


def _status(exit_status: str | None, info: dict) -> tuple[Status, str | None]:
    if not exit_status:
        return "aborted", "the source recorded no exit status"
    status = _STATUS.get(exit_status, "error")
    if status == "ok":
        return status, None
    reason = f"mini-swe-agent exit_status {exit_status!r}"
    detail = info.get("exception_str")
    if isinstance(detail, str) and detail.strip():
        reason += f": {detail.strip()[:500]}"
    return status, reason


def _task_id(data: dict, path: str | os.PathLike) -> str:
    instance = data.get("instance_id")
    if isinstance(instance, str) and instance:
        return instance
    name = Path(path).name
    for suffix in (".traj.json", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return Path(path).stem or name


def import_mini_swe_agent(data: Any, path: str | os.PathLike) -> Trajectory:
    """A mini-swe-agent trajectory object (parsed JSON) as a text-only trajectory."""
    r = Reader(path)
    if not isinstance(data, dict):
        raise r.error("(root)", f"expected a JSON object, got {type(data).__name__}")
    version = r.get(data, "trajectory_format", "", str)
    if not version.startswith(MINI_FORMAT_PREFIX):
        raise r.error("trajectory_format", f"{version!r} is not {MINI_FORMAT_PREFIX}-*")
    raw_messages = r.get(data, "messages", "", list)
    info = r.get(data, "info", "", dict, required=False) or {}
    exit_status = r.get(info, "exit_status", "info", (str, type(None)), required=False)
    submission = r.get(info, "submission", "info", (str, type(None)), required=False)

    items: list[Item] = []
    closing: dict | None = None  # v2's `role: "exit"` message
    for i, m in enumerate(raw_messages):
        if isinstance(m, dict) and m.get("role") == "exit":
            closing = extra_of(m)
            continue
        items.append((r.message(m, f"messages[{i}]"), m, f"messages[{i}]"))
    if closing is not None:
        found = closing.get("exit_status")
        exit_status = exit_status or (found if isinstance(found, str) else None)
        found = closing.get("submission")
        if submission is None and isinstance(found, str):
            submission = found
    elif exit_status and items:
        # v1 ends with a user message holding the submission ("" after LimitsExceeded).
        last, raw, _ = items[-1]
        after_agent = any(m["role"] == "assistant" for m, _, _ in items[:-1])
        v1_closing = last["role"] == "user" and not extra_of(raw)
        if after_agent and v1_closing and last["content"] == (submission or ""):
            items.pop()
    prompt, task, agent_at = split_prompt(r, items, "messages")
    turns = chat_turns(r, items, agent_at)
    status, reason = _status(exit_status, info)
    format_errors = sum(
        1 for _, raw, _ in items if extra_of(raw).get("interrupt_type") == "FormatError"
    )
    meta: dict[str, Any] = {
        "source_file": str(path),
        "source_format": "mini-swe-agent",
        "trajectory_format": version,
        "exit_status": exit_status,
        "submission": submission,
        "format_error_messages": format_errors,
    }
    for key in ("mini_version", "model_stats"):
        if isinstance(info.get(key), str | dict):
            meta[key] = info[key]
    config = info.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, dict) and isinstance(model.get("model_name"), str):
        meta["model_name"] = model["model_name"]
    return imported(
        _task_id(data, path),
        "mini-swe-agent",
        status=status,
        reason=reason,
        instruction=_task(task),
        prompt=prompt,
        turns=turns,
        meta=meta,
    )
