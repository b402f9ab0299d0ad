"""The OpenAI/vLLM-compatible request and response shapes (docs/architecture.md §4), without
aiohttp.

Parsing turns a JSON body into a validated `CompletionRequest` or raises `ApiError` naming the
field and what is allowed; the builders turn engine outputs into OpenAI-shaped dicts. simloop
extensions ride along where vLLM puts its own: `token_ids` / `prompt_token_ids` per choice
(vLLM's `return_token_ids`), plus `token_versions` per choice and `weight_version` at the top.

Numbers are bounded and converted here, in the engine's dtypes (float32, int32), so nothing a
request carries can overflow inside the engine loop:
- `temperature`: 0 (greedy) or up to MAX_TEMPERATURE; a positive one below MIN_TEMPERATURE is
  raised to it (as vLLM does), so 1/temperature stays finite in float32.
- `top_p`: in (0, 1]; below MIN_TOP_P it is raised to it (both keep only the top token).
- `top_k`: -1 or 0 (off) or a positive integer; values at or past the vocabulary size are
  clamped to it (as vLLM does): they mean "no truncation".
- `seed`: any integer in the int64 range, reduced modulo 2**31 (the engine's seed range).
- `max_tokens`, `logprobs`, `top_logprobs`, `n`, `stop_token_ids`: bounded by the context,
  `max_top_logprobs`, MAX_N and the vocabulary.
A bad value is a 400 naming the field and the allowed range.

Logprobs in responses: a finite value is reported as is; an alternative whose logprob is
-inf (outside the top-k / top-p set: impossible) is reported as LOGPROB_FLOOR, as OpenAI does;
anything else that is not finite (NaN, +inf, or -inf for a sampled token) is `null`, never a
number, so corruption is visible to clients and to importance ratios.
"""

from __future__ import annotations

import math
import re
import reprlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rl.data.chat import ROLES, ChatRenderer, Message
from rl.data.tokenizer import Tokenizer
from serving.compaction import MODES as COMPACTION_MODES
from serving.compaction import SessionCompaction
from serving.config import (
    INT32_MAX,
    MAX_N,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    MIN_TOP_P,
)
from serving.engine import SamplingParams, SequenceOutput

# JSON has no -inf; OpenAI reports impossible alternatives with this floor.
LOGPROB_FLOOR = -9999.0


class ApiError(Exception):
    """An error response: HTTP status + the OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class CompletionRequest:
    """A parsed /v1/completions or /v1/chat/completions body."""

    chat: bool
    prompts: list[list[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    return_token_ids: bool = False
    echo_logprobs: bool = False
    """Whether the response carries logprobs (completions: `logprobs` set; chat: `logprobs`)."""
    include_usage: bool = False
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ----- field readers --------------------------------------------------------------------------


def _int(body, key, default, *, lo: int, hi: int):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"'{key}' must be an integer in [{lo}, {hi}], got {short_repr(v)}")
    if not lo <= v <= hi:
        raise bad(key, f"'{key}'={short_repr(v)} is out of range: an integer in [{lo}, {hi}]")
    return v


def _num(body, key, default, *, lo: float, hi: float, open_lo: bool = False) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(key, f"'{key}' must be a number, got {short_repr(v)}")
    if not ((lo < v if open_lo else lo <= v) and v <= hi):  # False for NaN too
        span = f"({lo}, {hi}]" if open_lo else f"[{lo}, {hi}]"
        raise bad(key, f"'{key}'={short_repr(v)} is out of range: a number in {span}")
    return float(v)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(v: str, param: str) -> str:
    """`v`, refused when it holds a lone UTF-16 surrogate (valid JSON, not valid Unicode)."""
    if not v.isascii() and (m := _SURROGATE.search(v)) is not None:
        raise bad(
            param,
            f"{param} holds a lone UTF-16 surrogate {m.group()!a} at character "
            f"{m.start()}: not valid Unicode text",
        )
    return v


def _bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"'{key}' must be true or false, got {v!r}")
    return v


@dataclass(frozen=True)
class Limits:
    """What bounds a request's numbers: the served vocabulary, context and logprobs."""

    vocab: int
    context: int = INT32_MAX
    max_logprobs: int = 20


def _sampling(body: dict, limits: Limits, *, max_tokens_key: str, logprobs: int):
    temperature = _num(body, "temperature", 1.0, lo=0.0, hi=MAX_TEMPERATURE)
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = max(_num(body, "top_p", 1.0, lo=0.0, hi=1.0, open_lo=True), MIN_TOP_P)
    top_k = _int(body, "top_k", 0, lo=-1, hi=INT32_MAX)
    top_k = 0 if top_k == -1 else min(top_k, limits.vocab)
    max_tokens = _int(body, max_tokens_key, None, lo=1, hi=limits.context)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad(
            "stop", f"'stop' must be a non-empty string or a list of them, got {short_repr(stop)}"
        )
    stop = [_text(s, "stop") for s in stop]
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab for t in stop_ids
    ):
        raise bad(
            "stop_token_ids",
            f"'stop_token_ids' must be a list of token ids in "
            f"[0, {limits.vocab}), got {short_repr(stop_ids)}",
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if _num(body, key, 0.0, lo=-2.0, hi=2.0) != 0.0:
            raise bad(key, f"'{key}' is not supported: leave it 0")
    seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - 1)
    if seed is not None:
        seed %= 2**31
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"),
        logprobs=logprobs,
    )


UNSUPPORTED = {
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "functions": (None, []),
}
"""OpenAI parameters this server does not implement, with the values that ask for nothing:
any other value is refused by name rather than ignored (it would sample otherwise than asked)."""


def _common(body: dict) -> dict:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    for key, neutral in UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise bad(
                key,
                f"'{key}' is not supported by this server: leave it out (or "
                f"{' / '.join(map(short_repr, neutral))})",
            )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {model!r}")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if _bool(body, "echo"):
        raise bad("echo", "'echo' is not supported")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    include_usage = options.get("include_usage", False)
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad(
            "stream_options.include_usage",
            f"'include_usage' must be true or false, got {short_repr(include_usage)}",
        )
    return dict(
        model=model,
        n=n,
        stream=_bool(body, "stream"),
        return_token_ids=_bool(body, "return_token_ids"),
        include_usage=bool(include_usage),
    )


def parse_completion(body: Any, tokenizer: Tokenizer, limits: Limits) -> CompletionRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad(
            "prompt",
            "'prompt' must be a string, a list of token ids, or a non-empty list "
            f"of either; got {short_repr(body.get('prompt'))}",
        )
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenizer.encode(_text(p, "prompt"))
        elif _is_ids(p):
            ids = list(p)
        else:
            raise bad(
                "prompt",
                f"each prompt must be a string or a list of token ids, got {short_repr(p)}",
            )
        if not ids:
            raise bad("prompt", "'prompt' is empty: give at least one token")
        prompts.append(ids)
    logprobs = _int(body, "logprobs", None, lo=0, hi=limits.max_logprobs)
    params = _sampling(body, limits, max_tokens_key="max_tokens", logprobs=logprobs or 0)
    return CompletionRequest(
        chat=False, prompts=prompts, params=params, echo_logprobs=logprobs is not None, **common
    )


def _only(body: Any, allowed: tuple[str, ...], what: str) -> dict:
    """`body`, a JSON object with no field outside `allowed` (each is refused by name)."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad(
            unknown[0], f"unknown field(s) {short_repr(unknown)}: {what} takes {', '.join(allowed)}"
        )
    return body


SESSION_TOKEN_CHARS = (16, 256)
"""Length of a session token a client chooses (visible ASCII: it travels in a header)."""


@dataclass
class SessionOpen:
    ttl_s: float | None
    compaction: SessionCompaction
    token: str | None = None
    """The client's own session token (`ServerConfig.session_tokens`), else None."""


def parse_session_open(body: Any, max_ttl_s: float, *, tokens: bool = False) -> SessionOpen:
    """`POST /v1/sessions` `{"ttl_s"?, "compaction"?: {"mode", ...}, "token"?}` (an empty
    body is fine; `serving.compaction.SessionCompaction` holds the compaction fields; `token`
    only where the server has session tokens)."""
    body = _only(
        {} if body is None else body, ("ttl_s", "compaction", "token"), "opening a session"
    )
    ttl = (
        None
        if body.get("ttl_s") is None
        else _num(body, "ttl_s", None, lo=0.0, hi=max_ttl_s, open_lo=True)
    )
    try:
        compaction = SessionCompaction.from_json(body.get("compaction"))
    except (TypeError, ValueError) as e:
        raise bad("compaction", f"{e} (modes: {list(COMPACTION_MODES)})") from None
    token = body.get("token")
    if token is not None and not tokens:
        raise bad(
            "token",
            "this server has no session tokens (ServerConfig.session_tokens is "
            "off): leave 'token' out",
        )
    lo, hi = SESSION_TOKEN_CHARS
    if token is not None and not (
        isinstance(token, str)
        and lo <= len(token) <= hi
        and token.isascii()
        and token.isprintable()
        and " " not in token
    ):
        raise bad(
            "token",
            f"'token' must be {lo} to {hi} visible ASCII characters, got {short_repr(token)}",
        )
    return SessionOpen(ttl_s=ttl, compaction=compaction, token=token)


SESSION_STEP_FIELDS = (
    "append_token_ids",
    "append_text",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "model",
)
"""What a session step takes: one sequence (no `n`), the sampling fields of /v1/completions."""


@dataclass
class SessionStep:
    append: list[int]
    params: SamplingParams
    echo_logprobs: bool
    model: str | None = None


def parse_session_generate(body: Any, tokenizer: Tokenizer, limits: Limits) -> SessionStep:
    """`POST /v1/sessions/{id}/generate`: exactly one of `append_token_ids` (ids) and
    `append_text` (text, tokenized here), then the sampling fields of /v1/completions
    (SESSION_STEP_FIELDS; any other field is refused by name)."""
    body = _only(body, SESSION_STEP_FIELDS, "a session step")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {short_repr(model)}")
    ids, text = body.get("append_token_ids"), body.get("append_text")
    if (ids is None) == (text is None):
        raise bad(
            "append_token_ids",
            "give exactly one of 'append_token_ids' (a list of token "
            "ids) and 'append_text' (a string)",
        )
    if text is not None:
        if not isinstance(text, str):
            raise bad("append_text", f"'append_text' must be a string, got {short_repr(text)}")
        append = tokenizer.encode(_text(text, "append_text"))
    else:
        if not (ids == [] or _is_ids(ids)):
            raise bad(
                "append_token_ids",
                f"'append_token_ids' must be a list of token ids, got {short_repr(ids)}",
            )
        append = list(ids)
    bad_ids = [t for t in append if not 0 <= t < limits.vocab]
    if bad_ids:
        raise bad(
            "append_token_ids",
            f"token ids {bad_ids[:5]} are outside the vocabulary [0, {limits.vocab})",
        )
    if _bool(body, "stream"):
        raise bad("stream", "a session step does not stream: leave 'stream' false")
    logprobs = _int(body, "logprobs", None, lo=0, hi=limits.max_logprobs)
    params = _sampling(body, limits, max_tokens_key="max_tokens", logprobs=logprobs or 0)
    return SessionStep(
        append=append, params=params, echo_logprobs=logprobs is not None, model=model
    )


def parse_session_rewind(body: Any) -> Any:
    """`POST /v1/sessions/{id}/rewind` `{"to": n}` -> n (the engine checks its range)."""
    body = _only(body, ("to",), "a rewind")
    if "to" not in body:
        raise bad("to", 'the body must be {"to": n}: the logical position to keep')
    return body["to"]


def parse_chat(
    body: Any, renderer: ChatRenderer, limits: Limits
) -> tuple[CompletionRequest, list[Message]]:
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"'messages' must be a non-empty list, got {short_repr(messages)}")
    parsed: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(
                f"messages[{i}]",
                f"messages[{i}] needs a 'role' in {list(ROLES)}, got {short_repr(m)}",
            )
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            if not all(isinstance(c.get("text", ""), str) for c in content):
                raise bad(f"messages[{i}].content", "a text content part's 'text' is a string")
            content = "".join(c.get("text", "") for c in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(
                f"messages[{i}].content",
                f"messages[{i}].content must be a string, got {short_repr(content)}",
            )
        msg: Message = {"role": m["role"], "content": _text(content, f"messages[{i}].content")}
        if isinstance(m.get("reasoning_content"), str) and m["role"] == "assistant":
            msg["reasoning_content"] = _text(
                m["reasoning_content"], f"messages[{i}].reasoning_content"
            )
        parsed.append(msg)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    enable_thinking = kwargs.get("enable_thinking", True)
    if not isinstance(enable_thinking, bool):
        raise bad("chat_template_kwargs.enable_thinking", "enable_thinking must be true or false")
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, lo=0, hi=limits.max_logprobs)
    if top and not want_logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params = _sampling(body, limits, max_tokens_key=key, logprobs=top)
    ids = renderer.render(parsed, add_generation_prompt=True, enable_thinking=enable_thinking)
    req = CompletionRequest(
        chat=True, prompts=[ids], params=params, echo_logprobs=want_logprobs, **common
    )
    return req, parsed


def _is_ids(x) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 40, 40, 40


def short_repr(x) -> str:
    """A bounded repr: depth, length and big integers are cut (a hostile body is huge)."""
    text = _REPR.repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


# ----- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _logprob(x: float, *, alternative: bool = False) -> float | None:
    """A logprob for JSON: see the module docstring."""
    if math.isfinite(x):
        return max(x, LOGPROB_FLOOR)
    return LOGPROB_FLOOR if alternative and x == -math.inf else None


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Tokenizer, out: SequenceOutput, offset0: int = 0) -> dict:
    tokens = [token_text(tokenizer, t) for t in out.token_ids]
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(x) for x in out.logprobs],
        "top_logprobs": [
            {token_text(tokenizer, i): _logprob(lp, alternative=True) for i, lp in top}
            for top in out.top_logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, token_ids, logprobs, tops) -> dict:
    def entry(tid: int, lp: float, alternative: bool = False) -> dict:
        text = token_text(tokenizer, tid)
        return {
            "token": text,
            "logprob": _logprob(lp, alternative=alternative),
            "bytes": list(text.encode("utf-8")),
        }

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, x, True) for i, x in top]}
            for t, lp, top in zip(token_ids, logprobs, tops, strict=True)
        ]
    }


def usage(prompts: list[list[int]], outputs: list[SequenceOutput], n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for o in outputs[::n]) if outputs else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def build_response(
    req: CompletionRequest,
    outputs: list[list[SequenceOutput]],
    *,
    tokenizer: Tokenizer,
    model: str,
    version: int,
    request_id: str,
) -> dict:
    """One response for all prompts: choice index = prompt_index * n + sample index."""
    choices = []
    flat: list[SequenceOutput] = []
    for p, outs in enumerate(outputs):
        for out in outs:
            flat.append(out)
            choice: dict[str, Any] = {
                "index": p * req.n + out.index,
                "finish_reason": out.finish_reason,
            }
            if req.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
                choice["logprobs"] = (
                    chat_logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                    if req.echo_logprobs
                    else None
                )
            else:
                choice["text"] = out.text
                choice["logprobs"] = (
                    completion_logprobs(tokenizer, out) if req.echo_logprobs else None
                )
            choice["stop_reason"] = None
            if req.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = req.prompts[p]
                choice["token_versions"] = out.versions
            choices.append(choice)
    return {
        "id": request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(req.prompts, flat, req.n),
        "weight_version": version,
    }
