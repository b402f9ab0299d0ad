"""ChatML rendering (Qwen style) and append-only rendering for multi-turn episodes.

A message renders as `<|im_start|>{role}\\n{content}<|im_end|>\\n`; a tool message as a user
turn wrapping its content in `<tool_response>` tags, as Qwen3's template does. The generation
prompt is `<|im_start|>assistant\\n`, followed by Qwen3's empty think block
(`<think>\\n\\n</think>\\n\\n`) when thinking is disabled.

Differences from Qwen3's Jinja template, on purpose, so that history is never re-rendered:
assistant content is rendered verbatim (Qwen3 strips reasoning from earlier turns, which
changes the tokens of history: chat-template drift), a `reasoning_content` field, when present,
is rendered as `<think>\\n{reasoning}\\n</think>\\n\\n` before the content, and consecutive tool
messages are separate user turns (Qwen3 merges them into one).

Message content is text: its special-token strings are spelled with ordinary tokens
(`Tokenizer.encode_text`), so content such as `hi<|im_end|>\n<|im_start|>assistant` can never
forge a turn; only the template's own markers become special ids.

`ChatRenderer.append(ids, message)` returns only the ids of one more message (plus the
generation prompt) given the ids so far, including ids a model generated that stop at
`<|im_end|>` without the newline; `render(messages)` equals the concatenation of appends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NotRequired, TypedDict

from rl.data.tokenizer import END_THINK, IM_END, IM_START, THINK, Tokenizer

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class Message(TypedDict):
    role: Role
    content: str
    reasoning_content: NotRequired[str]


def _validate(message: Message, index: int | None = None) -> None:
    where = "message" if index is None else f"messages[{index}]"
    if not isinstance(message, dict):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {message!r}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role={role!r} is invalid: one of {list(ROLES)}")
    if not isinstance(message.get("content"), str):
        raise ValueError(f"{where}.content must be a string, got {message.get('content')!r}")
    reasoning = message.get("reasoning_content")
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise ValueError(f"{where}.reasoning_content is only allowed (as a string) on assistant")


_Parts = list[tuple[str, bool]]
"""Rendered text as (piece, is_marker): markers are the template's own special tokens; every
other piece (role names, tags, message content) is plain text and never becomes one."""


def _message_parts(message: Message) -> _Parts:
    _validate(message)
    role, content = message["role"], message["content"]
    if role == "tool":
        body = [(f"user\n<tool_response>\n{content}\n</tool_response>", False)]
    elif role == "assistant" and "reasoning_content" in message:
        reasoning = message["reasoning_content"].strip()
        body = [
            ("assistant\n", False),
            (THINK, True),
            (f"\n{reasoning}\n", False),
            (END_THINK, True),
            (f"\n\n{content}", False),
        ]
    else:
        body = [(f"{role}\n{content}", False)]
    return [(IM_START, True), *body, (IM_END, True), ("\n", False)]


def _generation_parts(enable_thinking: bool) -> _Parts:
    parts = [(IM_START, True), ("assistant\n", False)]
    if not enable_thinking:
        parts += [(THINK, True), ("\n\n", False), (END_THINK, True), ("\n\n", False)]
    return parts


def message_text(message: Message) -> str:
    """The text of one rendered message, trailing newline included."""
    return "".join(piece for piece, _ in _message_parts(message))


def generation_prompt(enable_thinking: bool = True) -> str:
    """The assistant header the model continues from."""
    return "".join(piece for piece, _ in _generation_parts(enable_thinking))


def render_text(
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = False,
    enable_thinking: bool = True,
) -> str:
    """The rendered conversation as text. Its ids come from `ChatRenderer`, not from
    `tokenizer.encode` of this text, which would turn special-token strings in content into
    control tokens."""
    for i, m in enumerate(messages):
        _validate(m, i)
    text = "".join(message_text(m) for m in messages)
    return text + generation_prompt(enable_thinking) if add_generation_prompt else text


class ChatRenderer:
    """Token-level ChatML rendering over any `Tokenizer` whose vocabulary has the ChatML
    specials as single tokens."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        try:
            self.im_end_id = tokenizer.token_id(IM_END)
            tokenizer.token_id(IM_START)
        except KeyError as e:
            raise ValueError(f"tokenizer cannot render ChatML: {e}") from e
        self.newline_ids = tokenizer.encode("\n")

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
    ) -> list[int]:
        for i, m in enumerate(messages):
            _validate(m, i)
        parts = [p for m in messages for p in _message_parts(m)]
        if add_generation_prompt:
            parts += _generation_parts(enable_thinking)
        return self._encode(parts)

    def append(
        self,
        ids: Sequence[int],
        message: Message,
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool = True,
    ) -> list[int]:
        """Ids to add after `ids` for one more `message` (and the generation prompt).

        `ids` must end at a message boundary: empty, after `<|im_end|>\\n`, or after a
        generated `<|im_end|>` (the missing newline is added here)."""
        prefix: list[int] = []
        if ids:
            tail = list(ids[-(1 + len(self.newline_ids)) :])
            if tail[-1] == self.im_end_id:
                prefix = list(self.newline_ids)
            elif tail != [self.im_end_id, *self.newline_ids]:
                raise ValueError(
                    "append: ids do not end at a message boundary (<|im_end|> or <|im_end|>\\n); "
                    f"last ids are {list(ids[-4:])}"
                )
        parts = _message_parts(message)
        if add_generation_prompt:
            parts += _generation_parts(enable_thinking)
        return prefix + self._encode(parts)

    def _encode(self, parts: _Parts) -> list[int]:
        """Markers through `encode` (their special ids), text through `encode_text` in maximal
        runs between markers: a tokenizer splits at specials anyway, so for content without
        special-token strings this equals `encode` of the whole text."""
        ids: list[int] = []
        run: list[str] = []
        for piece, marker in [*parts, ("", True)]:
            if not marker:
                run.append(piece)
                continue
            if run:
                ids += self.tokenizer.encode_text("".join(run))
                run = []
            if piece:
                ids += self.tokenizer.encode(piece)
        return ids
