"""Token-exact capture: per rollout, the chain of ids the model saw and sampled.

A rollout (named by the harness's API key) holds one or more *segments*. A segment is one
growing token sequence: its prompt rendered once, then per turn the ids the server sampled
(spliced verbatim, never re-tokenized) and the ids of the messages that came after them,
rendered append-only (`rl.data.chat.ChatRenderer.append`). Each request is matched against
the rollout's segments (newest first):

- **extension**: the request's system, tools and messages start with the segment's history
  (the assistant turns compared with what the middleware returned) and add only user / tool /
  system messages: those are rendered after the chain and the model continues from there;
- **retry**: the request is the one that produced the segment's last turn (an SDK retry after a
  lost response): that turn is dropped and sampled again from the same ids;
- **divergence** (history edited or compacted by the harness, a sub-agent's own conversation,
  other tools): a new segment, rendered from the request. Assistant turns inside it are
  rendered from text: their provenance in this context is unproven, so their loss mask is 0.

`loss_mask` is 1 exactly on sampled ids, each with its behaviour logprob and the weight version
that produced it. At most `segments_max` segments per rollout: one more ends the rollout
(`SegmentsExceeded`). `Rollout.trajectories(...)` writes each segment as a simloop trajectory
sharing `rollout_id`, the reward given by `reward_mode`.

Nothing here does I/O: `plan` decides what to send, `commit` records what came back, so a
request cancelled in between (a disconnected harness) leaves the chain as it was.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rl.data.chat import ChatRenderer, Message
from rl.data.tools import assistant_text
from rl.data.trajectory import Exclusion, Trajectory, Turn
from serving.middleware.config import REWARD_MODES
from serving.middleware.formats import Conversation, Msg, Reply


class SegmentsExceeded(Exception):
    """The harness rewrote its history more often than `segments_max` allows."""


@dataclass
class SegmentTurn:
    span: tuple[int, int]
    """`[start, end)` of the sampled ids in the segment's `token_ids`."""
    text: str
    finish: str
    env_messages: list[Message] = field(default_factory=list)
    """The messages rendered after this turn (the next request's new ones)."""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Segment:
    index: int
    header_key: str
    prompt: list[Message]
    """The chat messages rendered before the first sampled turn."""
    history: list[Msg] = field(default_factory=list)
    """The request messages covered so far, with the assistant turns as returned."""
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    turns: list[SegmentTurn] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "turns": len(self.turns),
            "tokens": len(self.token_ids),
            "sampled_tokens": sum(self.loss_mask),
        }


@dataclass
class Plan:
    """What one request sends to the server, and how to record the answer."""

    segment: Segment
    new: bool
    """A segment not yet in the rollout (divergence, or the first request)."""
    keep: int
    """Ids of the segment kept (fewer than it has on a retry)."""
    drop_turns: int
    appended: list[int]
    """Ids rendered for the request's new messages (and the generation prompt)."""
    messages: list[Message]
    """Those new messages, as rendered."""
    history: list[Msg]
    prompt_ids: list[int]
    kind: str
    """`new`, `extend` or `retry`."""


def to_chat(m: Msg) -> Message:
    if m.role == "assistant":
        calls = [c.plain() for c in m.tool_calls]
        return {"role": "assistant", "content": assistant_text(m.content, calls)}
    return {"role": m.role, "content": m.content}  # type: ignore[typeddict-item]


class Rollout:
    """One harness run: its segments, a lock that serialises its requests (SDK retries race),
    and its bookkeeping."""

    def __init__(self, rollout_id: str, *, api: str):
        self.id = rollout_id
        self.api = api
        self.lock = asyncio.Lock()
        self.segments: list[Segment] = []
        self.created = self.last_used = time.time()
        self.requests = 0
        self.inflight = 0
        """Requests in the middleware now: the one running and those waiting for the lock."""
        self.failure: str | None = None
        self.counts = {"new": 0, "extend": 0, "retry": 0}

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "api": self.api,
            "requests": self.requests,
            "segments": [s.summary() for s in self.segments],
            "plans": dict(self.counts),
            "idle_s": round(time.time() - self.last_used, 3),
            "failure": self.failure,
        }

    # ----- matching ----------------------------------------------------------------------

    def plan(
        self,
        conv: Conversation,
        renderer: ChatRenderer,
        *,
        segments_max: int,
        enable_thinking: bool,
    ) -> Plan:
        if self.failure:
            raise SegmentsExceeded(self.failure)
        msgs = list(conv.messages)
        for seg in reversed(self.segments):
            if seg.header_key != conv.header_key:
                continue
            h = seg.history
            if (
                len(msgs) > len(h)
                and msgs[: len(h)] == h
                and all(m.role != "assistant" for m in msgs[len(h) :])
            ):
                return self._extend(seg, msgs, renderer, enable_thinking)
            if seg.turns and h and h[-1].role == "assistant" and msgs == h[:-1]:
                keep = seg.turns[-1].span[0]
                return Plan(seg, False, keep, 1, [], [], msgs, seg.token_ids[:keep], "retry")
        if len(self.segments) >= segments_max:
            self.failure = (
                f"rollout {self.id!r} needed segment {len(self.segments) + 1} but segments_max "
                f"is {segments_max}: the harness rewrote its history (compaction, sub-agents, "
                "edited turns) more often than allowed"
            )
            raise SegmentsExceeded(self.failure)
        header = [{"role": "system", "content": conv.system_text}] if conv.system_text else []
        prompt: list[Message] = [*header, *(to_chat(m) for m in msgs)]  # type: ignore[list-item]
        ids = renderer.render(prompt, add_generation_prompt=True, enable_thinking=enable_thinking)
        seg = Segment(index=len(self.segments), header_key=conv.header_key, prompt=prompt)
        return Plan(seg, True, 0, 0, ids, [], msgs, ids, "new")

    @staticmethod
    def _extend(
        seg: Segment, msgs: list[Msg], renderer: ChatRenderer, enable_thinking: bool
    ) -> Plan:
        new = msgs[len(seg.history) :]
        ids = list(seg.token_ids)
        appended: list[int] = []
        rendered = [to_chat(m) for m in new]
        for k, message in enumerate(rendered):
            more = renderer.append(
                ids,
                message,
                add_generation_prompt=k == len(rendered) - 1,
                enable_thinking=enable_thinking,
            )
            ids += more
            appended += more
        return Plan(seg, False, len(seg.token_ids), 0, appended, rendered, msgs, ids, "extend")

    # ----- recording ---------------------------------------------------------------------

    def commit(
        self,
        plan: Plan,
        reply: Reply,
        *,
        token_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        text: str,
        eos_id: int,
    ) -> None:
        """Record a sampled turn (the server's ids, logprobs and versions, verbatim)."""
        if not token_ids or len(logprobs) != len(token_ids) or len(versions) != len(token_ids):
            raise ValueError(
                f"a sampled turn needs ids, logprobs and versions of one length; got "
                f"{len(token_ids)}, {len(logprobs)}, {len(versions)}"
            )
        seg = plan.segment
        if plan.new:
            self.segments.append(seg)
        del seg.token_ids[plan.keep :], seg.loss_mask[plan.keep :]
        del seg.logprobs[plan.keep :], seg.versions[plan.keep :]
        if plan.drop_turns:
            del seg.turns[-plan.drop_turns :]
        if plan.messages and seg.turns:
            seg.turns[-1].env_messages += plan.messages
        n = len(plan.appended)
        seg.token_ids += plan.appended
        seg.loss_mask += [0] * n
        seg.logprobs += [None] * n
        seg.versions += [None] * n
        start = len(seg.token_ids)
        seg.token_ids += token_ids
        seg.loss_mask += [1] * len(token_ids)
        seg.logprobs += [float(x) for x in logprobs]
        seg.versions += [int(v) for v in versions]
        span = (start, len(seg.token_ids))
        if token_ids[-1] != eos_id:  # cut by max_tokens or a stop string: close the turn
            seg.token_ids.append(eos_id)
            seg.loss_mask.append(0)
            seg.logprobs.append(None)
            seg.versions.append(None)
        seg.turns.append(
            SegmentTurn(span=span, text=text, finish=reply.finish, info={"plan": plan.kind})
        )
        seg.history = [*plan.history, reply.message()]
        self.counts[plan.kind] += 1

    # ----- writing -----------------------------------------------------------------------

    def trajectories(
        self,
        *,
        reward: float | None,
        status: str,
        reason: str | None,
        reward_mode: str,
        task_id: str | None = None,
        group_id: str = "",
        tokenizer: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> list[Trajectory]:
        """One trajectory per segment that sampled anything. `all_segments`: each carries the
        reward; `last_segment`: only the last trains, earlier ones are kept for inspection
        and excluded as `earlier_segment` (the RL batch skips them). `meta` is the harness's
        provenance, merged into each segment's."""
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode={reward_mode!r} is invalid: one of {list(REWARD_MODES)}")
        if self.failure and status == "ok":
            status, reason = "truncated", self.failure
        used = [s for s in self.segments if s.turns]
        out = []
        for k, seg in enumerate(used):
            turns = [
                Turn(
                    agent_text=t.text,
                    env_messages=list(t.env_messages),
                    token_span=t.span,
                    info={"finish_reason": t.finish, **t.info},
                )
                for t in seg.turns
            ]
            extra: dict[str, Any] = {
                "segment": k,
                "segments": len(used),
                "api": self.api,
                "reward_mode": reward_mode,
                **(meta or {}),
            }
            exclusion = None
            if reward_mode == "last_segment" and k < len(used) - 1:
                exclusion = Exclusion(
                    "earlier_segment", "reward_mode last_segment: only the last segment trains"
                )
            out.append(
                Trajectory(
                    task_id=task_id or self.id,
                    arm="real",
                    env_backend="harness",
                    status=status,  # type: ignore[arg-type]
                    reason=reason,
                    reward=reward,
                    group_id=group_id,
                    prompt=list(seg.prompt),
                    turns=turns,
                    source="sampler",
                    token_ids=list(seg.token_ids),
                    loss_mask=list(seg.loss_mask),
                    behavior_logprobs=list(seg.logprobs),
                    policy_version=list(seg.versions),
                    tokenizer=tokenizer,
                    meta=extra,
                    rollout_id=self.id,
                    exclusion=exclusion,
                )
            )
        return out
