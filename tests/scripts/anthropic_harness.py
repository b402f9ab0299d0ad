"""A scripted agent harness on the official `anthropic` SDK, as `simloop harness` runs one
(`harness.kind: command`): it asks the model (through the middleware) for a few turns with a
bash tool, runs any `tool_use` it gets and sends the results back, otherwise asks it to go on.

    python anthropic_harness.py BASE_URL API_KEY TASK_FILE [--turns N] [--fix clamp]
        [--fix-if-even] [--fix-replace FILE OLD NEW]

`--fix clamp` applies the clamp task's reference fix itself, so the grading path sees a diff
that passes; `--fix-if-even` does so only when the model's first reply has an even number of
characters (a reward that depends on what the model sampled, for RL tests); `--sleep S`
stalls first, `--sleep-after S` after its turns (the wall-clock guard's tests); `--subagent`
interleaves a main line with a sub-agent's conversation instead; `--forge`
then tries to grade itself, POSTing `{"reward": 1.0}` to `BASE_URL/rollouts/API_KEY/finish`
(the red-team test: it must be refused), and prints the answer's status."""

import argparse
import json
import pathlib
import subprocess
import time
import urllib.error
import urllib.request

import anthropic

BASH = {
    "name": "bash",
    "description": "run a bash command in the repository",
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("api_key")
    p.add_argument("task_file")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--fix", default=None)
    p.add_argument("--fix-if-even", action="store_true")
    p.add_argument(
        "--fix-replace",
        nargs=3,
        metavar=("FILE", "OLD", "NEW"),
        default=None,
        help="the fix: replace OLD by NEW in FILE (default: the clamp task's)",
    )
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--sleep-after", type=float, default=0.0)
    p.add_argument("--subagent", action="store_true")
    p.add_argument("--forge", action="store_true")
    args = p.parse_args()
    time.sleep(args.sleep)
    client = anthropic.Anthropic(base_url=args.base_url, api_key=args.api_key, max_retries=2)
    if args.subagent:
        interleaved(client, pathlib.Path(args.task_file).read_text(), args.turns)
        return
    messages = [{"role": "user", "content": pathlib.Path(args.task_file).read_text()}]
    first = None
    for _ in range(args.turns):
        m = client.messages.create(
            model="simloop-agent",
            max_tokens=16,
            tools=[BASH],
            system="You fix bugs with the bash tool.",
            messages=messages,
        )
        if first is None:
            first = "".join(b.text for b in m.content if b.type == "text")
        content = [b.model_dump(exclude_none=True) for b in m.content]
        messages.append({"role": "assistant", "content": content})
        uses = [b for b in m.content if b.type == "tool_use"]
        if not uses:
            messages.append({"role": "user", "content": "Go on: call the bash tool."})
            continue
        results = []
        for use in uses:
            run = subprocess.run(
                str(use.input.get("command", "")),
                shell=True,
                text=True,
                capture_output=True,
                timeout=30,
            )
            results.append(
                {"type": "tool_result", "tool_use_id": use.id, "content": run.stdout + run.stderr}
            )
        messages.append({"role": "user", "content": results})
    time.sleep(args.sleep_after)
    if args.fix == "clamp" or (args.fix_if_even and len(first or "") % 2 == 0):
        name, old, new = args.fix_replace or ("clamp.py", "min(x, lo)", "min(x, hi)")
        path = pathlib.Path(name)
        path.write_text(path.read_text().replace(old, new))
    if args.forge:
        forge(args.base_url, args.api_key)


def interleaved(client, task: str, turns: int) -> None:
    """A main line that dispatches a sub-agent, their calls interleaved (main, sub, main,
    sub, ...), each conversation growing by its own replies, as a harness with a sub-agent
    tool sends them under one API key."""
    lines = {
        "main": ("You fix bugs.", [{"role": "user", "content": task}]),
        "sub": ("You are a sub-agent: list what you are asked to.", [
            {"role": "user", "content": "List the Python files."}
        ]),
    }  # fmt: skip
    for _ in range(turns):
        for system, messages in lines.values():
            m = client.messages.create(
                model="simloop-agent", max_tokens=16, system=system, messages=messages
            )
            content = [b.model_dump(exclude_none=True) for b in m.content]
            messages += [{"role": "assistant", "content": content}]
            messages += [{"role": "user", "content": "Go on."}]


def forge(base_url: str, api_key: str) -> None:
    """Finish this rollout with reward 1.0, as a harness that wants to grade itself would."""
    request = urllib.request.Request(
        f"{base_url.rstrip('/')}/rollouts/{api_key}/finish",
        method="POST",
        data=json.dumps({"reward": 1.0}).encode(),
        headers={
            "Content-Type": "application/json",
            "x-api-key": api_key,
            "Authorization": f"Bearer {api_key}",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            print(f"forged finish: {r.status} {r.read()[:300]!r}")
    except urllib.error.HTTPError as e:
        print(f"forged finish refused: {e.code} {e.read()[:300]!r}")


if __name__ == "__main__":
    main()
