"""The OpenAI/vLLM-compatible request and response shapes (DESIGN.md §4), without aiohttp.

Parsing turns a JSON body into a validated `CompletionRequest` or raises `ApiError` naming the
field and what is allowed; the builders turn engine outputs into OpenAI-shaped dicts. simloop
extensions ride along where vLLM puts its own: `token_ids` / `prompt_token_ids` per choice
(vLLM's `return_token_ids`), plus `token_versions` per choice and `weight_version` at the top.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rl.data.chat import ROLES, ChatRenderer, Message
from rl.data.tokenizer import Tokenizer
from serving.config import MAX_N
from serving.engine import SamplingParams, SequenceOutput

# JSON has no -inf; OpenAI reports impossible alternatives with this floor.
LOGPROB_FLOOR = -9999.0


class ApiError(Exception):
    """An error response: HTTP status + the OpenAI error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str | None = None, code: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}  # fmt: skip


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
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


def _int(body, key, default=None, *, lo=None, hi=None, allowed=None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(key, f"'{key}' must be an integer{_range(lo, hi)}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad(key, allowed or f"'{key}'={v} is out of range: an integer{_range(lo, hi)}")
    return v


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f" in [{lo}, {hi}]"
    if lo is not None:
        return f" >= {lo}"
    return ""


def _num(body, key, default):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad(key, f"'{key}' must be a finite number, got {v!r}")
    return float(v)


def _bool(body, key, default=False):
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(key, f"'{key}' must be true or false, got {v!r}")
    return v


def _sampling(body: dict, *, max_tokens_key: str, logprobs: int) -> SamplingParams:
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"'temperature'={temperature} is invalid: a number >= 0")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"'top_p'={top_p} is invalid: a number in (0, 1]")
    top_k = _int(body, "top_k", 0, lo=-1)
    max_tokens = _int(body, max_tokens_key, None)
    if max_tokens is not None and max_tokens <= 0:
        raise bad(max_tokens_key, f"'{max_tokens_key}'={max_tokens} is invalid: an integer >= 1")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"'stop' must be a non-empty string or a list of them, got {stop!r}")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids
    ):
        raise bad(
            "stop_token_ids", f"'stop_token_ids' must be a list of token ids, got {stop_ids!r}"
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if _num(body, key, 0.0) != 0.0:
            raise bad(key, f"'{key}' is not supported: leave it 0")
    seed = _int(body, "seed", None)
    if seed is not None:
        seed %= 2**31
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
        seed=seed, stop=tuple(stop), stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool(body, "ignore_eos"), logprobs=logprobs,
    )  # fmt: skip


def _common(body: dict) -> dict:
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {model!r}")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if _bool(body, "echo"):
        raise bad("echo", "'echo' is not supported")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "'stream_options' must be an object")
    return dict(model=model, n=n, stream=_bool(body, "stream"),
                return_token_ids=_bool(body, "return_token_ids"),
                include_usage=bool(options.get("include_usage")))  # fmt: skip


def parse_completion(body: Any, tokenizer: Tokenizer, max_logprobs: int) -> CompletionRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "'prompt' must be a string, a list of token ids, or a non-empty list "
                  f"of either; got {_short(body.get('prompt'))}")  # fmt: skip
    prompts = []
    for p in prompt:
        if isinstance(p, str):
            ids = tokenizer.encode(p)
        elif _is_ids(p):
            ids = list(p)
        else:
            raise bad(
                "prompt", f"each prompt must be a string or a list of token ids, got {_short(p)}"
            )
        if not ids:
            raise bad("prompt", "'prompt' is empty: give at least one token")
        prompts.append(ids)
    logprobs = _int(body, "logprobs", None, lo=0, hi=max_logprobs)
    params = _sampling(body, max_tokens_key="max_tokens", logprobs=logprobs or 0)
    return CompletionRequest(chat=False, prompts=prompts, params=params,
                             echo_logprobs=logprobs is not None, **common)  # fmt: skip


def parse_chat(
    body: Any, renderer: ChatRenderer, max_logprobs: int
) -> tuple[CompletionRequest, list[Message]]:
    common = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"'messages' must be a non-empty list, got {_short(messages)}")
    parsed: list[Message] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}]", f"messages[{i}] needs a 'role' in {list(ROLES)}, got "
                      f"{_short(m)}")  # fmt: skip
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(isinstance(c, dict) and c.get("type") == "text" for c in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(str(c.get("text", "")) for c in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string, got "
                      f"{_short(content)}")  # fmt: skip
        msg: Message = {"role": m["role"], "content": content}
        if isinstance(m.get("reasoning_content"), str) and m["role"] == "assistant":
            msg["reasoning_content"] = m["reasoning_content"]
        parsed.append(msg)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    enable_thinking = kwargs.get("enable_thinking", True)
    if not isinstance(enable_thinking, bool):
        raise bad("chat_template_kwargs.enable_thinking", "enable_thinking must be true or false")
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, lo=0, hi=max_logprobs)
    if top and not want_logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    params = _sampling(body, max_tokens_key=key, logprobs=top)
    ids = renderer.render(parsed, add_generation_prompt=True, enable_thinking=enable_thinking)
    req = CompletionRequest(chat=True, prompts=[ids], params=params,
                            echo_logprobs=want_logprobs, **common)  # fmt: skip
    return req, parsed


def _is_ids(x) -> bool:
    return (
        isinstance(x, list)
        and bool(x)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    )


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


# ----- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _floor(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


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
        "token_logprobs": [_floor(x) for x in out.logprobs],
        "top_logprobs": [
            {token_text(tokenizer, i): _floor(lp) for i, lp in top} for top in out.top_logprobs
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Tokenizer, token_ids, logprobs, tops) -> dict:
    def entry(tid: int, lp: float) -> dict:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": _floor(lp), "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, x) for i, x in top]}
            for t, lp, top in zip(token_ids, logprobs, tops, strict=True)
        ]
    }


def usage(prompts: list[list[int]], outputs: list[SequenceOutput], n: int) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(o.cached_tokens for o in outputs[::n]) if outputs else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


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
            choice: dict[str, Any] = {"index": p * req.n + out.index,
                                      "finish_reason": out.finish_reason}  # fmt: skip
            if req.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
                choice["logprobs"] = (
                    chat_logprobs(tokenizer, out.token_ids, out.logprobs, out.top_logprobs)
                    if req.echo_logprobs else None
                )  # fmt: skip
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
