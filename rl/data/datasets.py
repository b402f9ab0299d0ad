"""SFT examples from trajectories (simulator and agent) and grain pipelines that pack them into
fixed `[B, T]` batches with a checkpointable iterator. `DatasetConfig` imports no JAX (grain,
which does, is imported when a dataset is built).

Examples are dicts of int32 arrays `tokens` and `loss_mask` (1 on the tokens to learn; a
workspace-mode simulator example holds `DatasetConfig.observation_weight` on its observation):
- simulator: context = the session up to and including the command, rendered by
  `rl.data.sim_format` (the format `SimulatedShell` prompts with, thinking disabled, generation
  prompt included); target = `format_observation(output, exit_code)` + `<|im_end|>`.
- agent: a trajectory's token view, loss on the agent's generated tokens.

Batch convention (next-token targets are shifted per example, before packing, so that no target
crosses a segment): for every row b and position t,
- `tokens[b, t]` is the model input and `positions[b, t]` its position in its segment (0-based,
  restarting at every segment); `segment_ids[b, t]` is 1, 2, ... per packed example and 0 on
  padding. Attention must be causal and within one segment id.
- `targets[b, t]` is the token that follows `tokens[b, t]` in the same example: the trainer's
  loss is `CE(logits[b, t], targets[b, t])` where `loss_mask[b, t] >= 1` (never on padding),
  weighted by it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rl import validate
from rl.data.chat import ChatRenderer
from rl.data.sim_format import (
    apply_changes,
    format_observation,
    format_workspace_reply,
    kept_history,
    parse_changes,
    render_sim_messages,
    render_workspace_messages,
    start_workspace,
    workspace_changes,
)
from rl.data.tokenizer import IM_END, Tokenizer, common_prefix_len
from rl.data.trajectory import Trajectory, render_token_view

if TYPE_CHECKING:
    import grain

Example = dict[str, np.ndarray]
FEATURES = ("tokens", "targets", "loss_mask")


@dataclass(frozen=True)
class DatasetConfig:
    """Packing and ordering of an SFT dataset."""

    seq_len: int = 2048
    """T: tokens per packed row; longer examples are truncated when built."""
    batch_size: int = 8
    """B: rows per batch (also the number of first-fit packing bins)."""
    seed: int = 0
    """Seeds the example shuffle and the bin shuffle: same seed, same batches."""
    num_epochs: int | None = 1
    """Passes over the examples; None repeats forever (reshuffled every epoch)."""
    shuffle: bool = True
    """Shuffle examples (and packed rows); False keeps the examples' order."""
    missing_exit_code: int | None = 0
    """Simulator examples: the return code written for turns whose source recorded none
    (SWE-agent does not); None skips trajectories with such turns instead."""
    cut_targets: bool = False
    """Simulator examples: an observation too long to fit a row whole even beside the
    shortest context (the files and the command, no earlier turns) is trained on its first
    tokens that fit there, without the end-of-turn token, instead of skipped. Its return code
    and first lines are what the simulator most needs of it (a long usage text after a
    misspelt program); the simulator is stopped at its token cap on such outputs anyway, and
    no end-of-turn is taught where the real output does not end."""
    observation_weight: int = 1
    """Simulator examples in workspace mode: how many times each token of the observation
    counts in the loss against one token of the changes block after it (`loss_mask` holds
    the weight; the loss is the weighted mean). A read's answer is a few bytes of its
    observation, where a write's changes repeat whole files."""
    exit_code_weight: int = 1
    """Simulator examples: how many times each token of the return code's digits (the `N`
    of `<returncode>N</returncode>`) counts in the loss, whatever `observation_weight` gives
    the rest of the observation. The return code decides everything after it (`0` and
    silence, or `127` and `command not found`), yet it is one or two of a reply's hundred
    tokens and nearly always `0`: a misspelt program's `127` barely moves the mean loss."""

    def __post_init__(self) -> None:
        validate.integer(self, "seq_len", low=2)
        validate.integer(self, "observation_weight", low=1)
        validate.integer(self, "exit_code_weight", low=1)
        validate.integer(self, "batch_size", low=1)
        validate.integer(self, "seed", low=0)
        validate.integer(self, "num_epochs", low=1, optional=True)
        validate.integer(self, "missing_exit_code", optional=True)


@dataclass
class SFTStats:
    """What building examples kept, cut and skipped (and why)."""

    examples: int = 0
    target_tokens: int = 0
    context_tokens: int = 0
    truncated: int = 0
    """Examples whose context (simulator) or tail (agent) was cut to fit."""
    cut_targets: int = 0
    """Simulator examples whose observation was cut to fit (`DatasetConfig.cut_targets`)."""
    skipped: Counter = field(default_factory=Counter)
    """Reason -> count of skipped examples (or trajectories)."""

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "skipped": dict(self.skipped)}


@dataclass(frozen=True)
class _Obs:
    output: str
    exit_code: int


def _header(exit_code: int) -> str:
    """The observation's first lines, up to where its output starts."""
    return format_observation("", exit_code).split("\n</output>")[0]


def _example(
    context: Sequence[int],
    target: Sequence[int],
    *,
    weighted: int = 0,
    weight: int = 1,
    code: tuple[int, int] = (0, 0),
    code_weight: int = 1,
) -> Example:
    """The tokens and their loss mask: 1 on the target, `weight` on its first `weighted`,
    `code_weight` on its tokens `code[0]:code[1]` (the return code's digits)."""
    tokens = np.asarray([*context, *target], dtype=np.int32)
    mask = np.zeros(len(tokens), dtype=np.int32)
    mask[len(context) :] = 1
    mask[len(context) : len(context) + weighted] = weight
    if code_weight != 1:
        mask[len(context) + code[0] : len(context) + code[1]] = code_weight
    return {"tokens": tokens, "loss_mask": mask}


def _code_span(
    target: Sequence[int], exit_code: int, text: Callable[[str], list[int]]
) -> tuple[int, int]:
    """Where the return code's digits are among `target`'s tokens: after the tokens it
    shares with `<returncode>` alone, up to the end of those it shares with the whole
    `<returncode>N</returncode>`, less the closing tag's tokens (exactly the digits with a
    byte tokenizer; with a BPE one, the tokens its merges leave there)."""
    start = common_prefix_len(target, text("<returncode>"))
    end = common_prefix_len(target, text(f"<returncode>{int(exit_code)}</returncode>"))
    return start, max(start, end - len(text("</returncode>")))


def _sim_pairs(traj: Trajectory, missing_exit_code: int | None) -> list[tuple[str, _Obs]] | None:
    """(command, observation) of the turns that ran a command; None when a return code is
    missing and there is no stand-in for it."""
    pairs = []
    for turn in traj.turns:
        if turn.command is None or turn.observation is None:
            continue
        code = turn.exit_code if turn.exit_code is not None else missing_exit_code
        if code is None:
            return None
        pairs.append((turn.command, _Obs(turn.observation, code)))
    return pairs


def sim_commands(traj: Trajectory) -> list[str]:
    """The commands of `traj` that give simulator examples (each turn that ran a command and
    has its observation), in order: what `envs.workspace` replays for workspace mode."""
    return [t.command for t in traj.turns if t.command is not None and t.observation is not None]


WorkspaceStates = Callable[[Trajectory], Sequence[Mapping[str, str]] | None]
"""Workspace mode's real states of a trajectory: [at the start, after each `sim_commands`
command], or None when there are none (`envs.workspace.replay_workspaces` makes them)."""


def sim_sft_examples(
    trajectories: Iterable[Trajectory],
    tokenizer: Tokenizer,
    *,
    max_len: int,
    missing_exit_code: int | None = 0,
    system_prompt: str | None = None,
    show_task: bool = True,
    context_budget: int | None = None,
    cut_targets: bool = False,
    workspaces: WorkspaceStates | None = None,
    observation_weight: int = 1,
    exit_code_weight: int = 1,
    named_last: bool = False,
    named_absent: bool = False,
) -> tuple[list[Example], SFTStats]:
    """One example per command with a real observation, rendered as `SimulatedShell` prompts
    (`system_prompt` / `show_task` as in its `SimulatedShellConfig`). A context over its
    budget loses whole turns, oldest first (`sim_format.kept_history`, the rule the simulated
    shell asks with); the system/task prefix and the current command are always kept. The
    budget is `context_budget` when given (the shell's `prompt_budget`, so
    training sees exactly the prompts serving will send) and never more than `max_len` minus
    the target. An example that cannot keep the prefix and command is skipped; so is one whose
    target is too long to fit beside them, unless `cut_targets` (`DatasetConfig.cut_targets`):
    then it keeps the target's first tokens that fit, without the end-of-turn token (nothing
    teaches the simulator to stop where the real output goes on), if they hold at least the
    return-code header.

    With `workspaces` (`SimulatedShellConfig.workspace`), each example is instead the
    workspace prompt (`render_workspace_messages`: the real files before the command, the
    command) and its target the observation with the files it changed
    (`format_workspace_reply`); a trajectory without states is skipped (`no_workspace`).
    There `observation_weight` (`DatasetConfig.observation_weight`) is the loss weight of the
    observation's tokens, the changes block's being 1, `named_last`
    (`SimulatedShellConfig.workspace_named_last`) lists the files the command names last and
    `named_absent` (`workspace_named_absent`) the names it gives that are not there. In
    either mode `exit_code_weight`
    (`DatasetConfig.exit_code_weight`) is the loss weight of the return code's digits."""
    stats = SFTStats()
    examples = [
        e
        for _, _, e in _sim_examples(
            trajectories,
            tokenizer,
            stats,
            max_len=max_len,
            missing_exit_code=missing_exit_code,
            system_prompt=system_prompt,
            show_task=show_task,
            context_budget=context_budget,
            cut_targets=cut_targets,
            workspaces=workspaces,
            observation_weight=observation_weight,
            exit_code_weight=exit_code_weight,
            named_last=named_last,
            named_absent=named_absent,
        )
    ]
    return examples, stats


def _sim_examples(
    trajectories: Iterable[Trajectory],
    tokenizer: Tokenizer,
    stats: SFTStats,
    *,
    max_len: int,
    missing_exit_code: int | None = 0,
    system_prompt: str | None = None,
    show_task: bool = True,
    context_budget: int | None = None,
    cut_targets: bool = False,
    workspaces: WorkspaceStates | None = None,
    observation_weight: int = 1,
    exit_code_weight: int = 1,
    named_last: bool = False,
    named_absent: bool = False,
) -> Iterator[tuple[Trajectory, int, Example]]:
    """`sim_sft_examples`, one at a time: (its trajectory, the index of its command among the
    trajectory's commands, the example), counting into `stats`."""
    renderer, text = ChatRenderer(tokenizer), tokenizer.encode_text
    end_of_turn = tokenizer.token_id(IM_END)
    gen_prompt = renderer.render([], add_generation_prompt=True, enable_thinking=False)
    for traj in trajectories:
        if traj.env_backend == "simulated":  # observations the simulator wrote itself
            stats.skipped["simulated_observations"] += 1
            continue
        pairs = _sim_pairs(traj, missing_exit_code)
        if not pairs:
            stats.skipped["missing_exit_code" if pairs is None else "no_commands"] += 1
            continue
        if workspaces is not None:
            yield from _workspace_examples(
                traj,
                pairs,
                workspaces(traj),
                renderer,
                text,
                end_of_turn,
                stats,
                max_len=max_len if context_budget is None else min(max_len, context_budget),
                target_room=max_len,
                system_prompt=system_prompt,
                show_task=show_task,
                cut_targets=cut_targets,
                observation_weight=observation_weight,
                exit_code_weight=exit_code_weight,
                named_last=named_last,
                named_absent=named_absent,
            )
            continue
        messages = render_sim_messages(
            traj.instruction,
            pairs[:-1],
            pairs[-1][0],
            setup_files=traj.setup_files,
            system_prompt=system_prompt,
            show_task=show_task,
        )
        # ChatML messages start and end at special tokens, so rendering them one by one gives
        # the ids of the whole rendering (the tests check this against ChatRenderer.render).
        ids = [renderer.render([m]) for m in messages]
        system, commands, answers = ids[0], ids[1::2], ids[2::2]
        for k, (_, obs) in enumerate(pairs):
            # An observation is content: special-token strings in it stay text.
            target = text(format_observation(obs.output, obs.exit_code)) + [end_of_turn]
            suffix = commands[k] + gen_prompt
            budget = max_len - len(target)
            if context_budget is not None:
                budget = min(budget, context_budget)
            shortest = len(system) + len(suffix)
            limit = max_len if context_budget is None else min(max_len, context_budget)
            cut = (
                cut_targets
                and budget < shortest <= limit
                and max_len - shortest > len(text(_header(obs.exit_code)))
            )
            if cut:  # the shortest context, and the target's first tokens beside it
                budget, target = shortest, target[: max_len - shortest]
                stats.cut_targets += 1
            if shortest > budget:
                stats.skipped["too_long"] += 1
                continue
            turns = [commands[j] + answers[j] for j in range(k)]
            n = kept_history(len(system), [len(t) for t in turns], len(suffix), budget)
            if n < k:
                stats.truncated += 1
            context = system + [t for turn in turns[k - n :] for t in turn] + suffix
            stats.examples += 1
            stats.target_tokens += len(target)
            stats.context_tokens += len(context)
            code = _code_span(target, obs.exit_code, text)
            yield traj, k, _example(context, target, code=code, code_weight=exit_code_weight)


def _workspace_examples(
    traj: Trajectory,
    pairs: list[tuple[str, _Obs]],
    states: Sequence[Mapping[str, str]] | None,
    renderer: ChatRenderer,
    text: Callable[[str], list[int]],
    end_of_turn: int,
    stats: SFTStats,
    *,
    max_len: int,
    target_room: int,
    system_prompt: str | None,
    show_task: bool,
    cut_targets: bool,
    observation_weight: int = 1,
    exit_code_weight: int = 1,
    named_last: bool = False,
    named_absent: bool = False,
) -> Iterator[tuple[Trajectory, int, Example]]:
    """Workspace-mode examples of one trajectory (`sim_sft_examples`): the prompt holds the
    files before command k (`max_len` bounds it: the shell's prompt budget), the target the
    observation and the changes to the files after it (the context and the target together
    within `target_room`)."""
    if states is None or len(states) != len(pairs) + 1:
        stats.skipped["no_workspace"] += 1
        return
    # The files in the order the shell keeps them (`apply_changes`: newest last), which the
    # real states (snapshots) do not have.
    current = start_workspace(states[0])
    for k, (command, obs) in enumerate(pairs):
        messages = render_workspace_messages(
            traj.instruction,
            current,
            command,
            system_prompt=system_prompt,
            show_task=show_task,
            named_last=named_last,
            named_absent=named_absent,
        )
        changes = workspace_changes(states[k], states[k + 1])
        current = apply_changes(current, parse_changes(changes))
        # exactly the ids `SimulatedShell` sends
        context = renderer.render(messages, add_generation_prompt=True, enable_thinking=False)
        reply = format_workspace_reply(obs.output, obs.exit_code, changes)
        target = text(reply) + [end_of_turn]
        # the observation's tokens: those the reply shares with the observation alone (all of
        # them with a byte tokenizer; a BPE merge across the boundary leaves that token at 1)
        weighted = 0
        if observation_weight != 1:
            observed = text(format_observation(obs.output, obs.exit_code))
            weighted = common_prefix_len(target, observed)
        if len(context) > max_len:
            stats.skipped["too_long"] += 1
            continue
        if len(context) + len(target) > target_room:
            if not cut_targets or target_room - len(context) <= len(text(_header(obs.exit_code))):
                stats.skipped["too_long"] += 1
                continue
            target = target[: target_room - len(context)]
            stats.cut_targets += 1
        stats.examples += 1
        stats.target_tokens += len(target)
        stats.context_tokens += len(context)
        code = _code_span(target, obs.exit_code, text)
        yield (
            traj,
            k,
            _example(
                context,
                target,
                weighted=weighted,
                weight=observation_weight,
                code=code,
                code_weight=exit_code_weight,
            ),
        )


def labelled_sim_examples(
    trajectories: Iterable[Trajectory],
    label: Callable[[Trajectory], str],
    tokenizer: Tokenizer,
    *,
    min_turn: int = 0,
    **kwargs: Any,
) -> tuple[list[Example], list[str]]:
    """`sim_sft_examples` (same keyword arguments) with each example's label: `label(traj)`
    of the trajectory it came from (e.g. its task kind, for a held-out curve by kind). Only
    the commands from the `min_turn`-th on (0-based) give examples: `min_turn=1` scores a
    session's later commands, each with the turns before it in its context."""
    kept = [
        (traj, example)
        for traj, k, example in _sim_examples(trajectories, tokenizer, SFTStats(), **kwargs)
        if k >= min_turn
    ]
    return [e for _, e in kept], [label(t) for t, _ in kept]


def agent_sft_examples(
    trajectories: Iterable[Trajectory],
    *,
    max_len: int,
    renderer: ChatRenderer | None = None,
    enable_thinking: bool = False,
) -> tuple[list[Example], SFTStats]:
    """One example per trajectory: its token view, loss on the agent's generated tokens. With
    a `renderer`, text-only trajectories (`source="rendered"`: imported, scripted) are rendered
    anew with it, so they match the tokenizer being trained; sampled ids are never re-rendered.
    Longer token views keep their first `max_len` tokens (a causal prefix stays exact)."""
    examples: list[Example] = []
    stats = SFTStats()
    for traj in trajectories:
        if renderer is not None and traj.source == "rendered":
            traj = dataclasses.replace(traj, turns=[dataclasses.replace(t) for t in traj.turns])
            render_token_view(traj, renderer, enable_thinking=enable_thinking)
        if not traj.token_ids:
            stats.skipped["no_token_view"] += 1
            continue
        tokens = np.asarray(traj.token_ids[:max_len], dtype=np.int32)
        mask = np.asarray(traj.loss_mask[:max_len], dtype=np.int32)
        if not mask.any():
            stats.skipped["no_target_within_max_len"] += 1
            continue
        stats.truncated += len(traj.token_ids) > max_len
        examples.append({"tokens": tokens, "loss_mask": mask})
        stats.examples += 1
        stats.target_tokens += int(mask.sum())
        stats.context_tokens += int(len(mask) - mask.sum())
    return examples, stats


def shift(example: Example) -> Example:
    """Next-token form of one example: inputs, the token after each, and the mask of that."""
    tokens, mask = example["tokens"], example["loss_mask"]
    return {"tokens": tokens[:-1], "targets": tokens[1:], "loss_mask": mask[1:]}


def padded_batches(
    examples: Sequence[Example], *, batch_size: int, pad_id: int
) -> Iterator[tuple[int, Example]]:
    """Unpacked evaluation batches: (rows used, `[B, L]` batch), one shifted example per row,
    padded to the chunk's longest (L) and to `batch_size` rows; the keys of a packed batch."""
    rows = [shift(e) for e in examples]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r["tokens"]) for r in chunk)
        batch = {k: np.zeros((batch_size, width), np.int32) for k in (*FEATURES, "segment_ids")}
        batch["tokens"][:] = pad_id
        batch["targets"][:] = pad_id
        batch["positions"] = np.zeros((batch_size, width), np.int32)
        for i, r in enumerate(chunk):
            n = len(r["tokens"])
            for k in FEATURES:
                batch[k][i, :n] = r[k]
            batch["segment_ids"][i, :n] = 1
            batch["positions"][i, :n] = np.arange(n)
        yield len(chunk), batch


def _row(packed: Example) -> Example:
    return {
        "tokens": packed["tokens"],
        "targets": packed["targets"],
        "loss_mask": packed["loss_mask"],
        "segment_ids": packed["tokens_segment_ids"],
        "positions": packed["tokens_positions"],
    }


def _stack(rows: Sequence[Example], *, batch_size: int, seq_len: int, pad_id: int) -> Example:
    """Stack rows into `[B, T]`, adding all-padding rows to a short final batch."""
    batch = {k: np.stack([r[k] for r in rows]).astype(np.int32) for k in rows[0]}
    missing = batch_size - len(rows)
    if missing:
        for k, v in batch.items():
            fill = pad_id if k in ("tokens", "targets") else 0
            batch[k] = np.concatenate([v, np.full((missing, seq_len), fill, np.int32)])
    return batch


def packed_dataset(
    examples: Sequence[Example], cfg: DatasetConfig, *, pad_id: int
) -> grain.IterDataset:
    """A `grain.IterDataset` of `[B, T]` batches (see the module docstring for the keys).
    Deterministic for `cfg.seed`; `iter(ds)` gives a `grain.DatasetIterator` whose
    `get_state()` / `set_state()` save and restore the position exactly."""
    import grain  # imports JAX: only here, so that DatasetConfig stays instant to import
    from grain.experimental import FirstFitPackIterDataset

    if not examples:
        raise ValueError("packed_dataset: no examples to pack")
    T = cfg.seq_len
    for i, ex in enumerate(examples):
        if not 2 <= len(ex["tokens"]) <= T + 1:
            raise ValueError(
                f"examples[{i}] has {len(ex['tokens'])} tokens: build examples with "
                f"max_len=seq_len+1={T + 1} (shifting drops one), and at least 2"
            )
    ds = grain.MapDataset.source(list(examples))
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs).map(shift).to_iter_dataset()
    ds = FirstFitPackIterDataset(
        ds,
        length_struct={k: T for k in FEATURES},
        num_packing_bins=cfg.batch_size,
        seed=cfg.seed,
        shuffle_bins=cfg.shuffle,
        padding_struct={"tokens": pad_id, "targets": pad_id, "loss_mask": 0},
    )
    batch_fn = functools.partial(_stack, batch_size=cfg.batch_size, seq_len=T, pad_id=pad_id)
    return ds.map(_row).batch(cfg.batch_size, drop_remainder=False, batch_fn=batch_fn)


def _check_built(examples: list[Example], stats: SFTStats, kind: str) -> None:
    if not examples:
        raise ValueError(
            f"no {kind} SFT examples: skipped {dict(stats.skipped)} "
            "(a longer seq_len keeps more; see SFTStats)"
        )


def sim_sft_dataset(
    trajectories: Iterable[Trajectory],
    tokenizer: Tokenizer,
    cfg: DatasetConfig,
    *,
    system_prompt: str | None = None,
    show_task: bool = True,
    context_budget: int | None = None,
    workspaces: WorkspaceStates | None = None,
    named_last: bool = False,
    named_absent: bool = False,
) -> tuple[grain.IterDataset, SFTStats]:
    """Simulator SFT batches from real trajectories (prompt options as `sim_sft_examples`)."""
    examples, stats = sim_sft_examples(
        trajectories,
        tokenizer,
        max_len=cfg.seq_len + 1,
        missing_exit_code=cfg.missing_exit_code,
        system_prompt=system_prompt,
        show_task=show_task,
        context_budget=context_budget,
        cut_targets=cfg.cut_targets,
        workspaces=workspaces,
        observation_weight=cfg.observation_weight,
        exit_code_weight=cfg.exit_code_weight,
        named_last=named_last,
        named_absent=named_absent,
    )
    _check_built(examples, stats, "simulator")
    return packed_dataset(examples, cfg, pad_id=tokenizer.pad_id), stats


def agent_sft_dataset(
    trajectories: Iterable[Trajectory],
    renderer: ChatRenderer,
    cfg: DatasetConfig,
    *,
    enable_thinking: bool = False,
) -> tuple[grain.IterDataset, SFTStats]:
    """Agent SFT batches (warm start) from trajectories' token views."""
    examples, stats = agent_sft_examples(
        trajectories, max_len=cfg.seq_len + 1, renderer=renderer, enable_thinking=enable_thinking
    )
    _check_built(examples, stats, "agent")
    return packed_dataset(examples, cfg, pad_id=renderer.tokenizer.pad_id), stats
