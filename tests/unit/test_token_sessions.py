"""Sessions the client keeps for a server without them (vLLM): each call is one completion of
what the session may see, and every call whose prompt is not the last call's sequence extended
is reported as a context reset, in the session's logical positions."""

from __future__ import annotations

import dataclasses

import pytest

from serving.client import ClientConfig, ClientError, Completion, InferenceClient
from serving.token_sessions import TokenSessions


class Recorder:
    """`complete` that answers `gen` tokens counting up from 100 and records each prompt."""

    def __init__(self, gen: int = 2):
        self.prompts: list[list[int]] = []
        self.gen, self.next = gen, 100

    async def complete(self, prompt, **kw):
        self.prompts.append(list(prompt))
        ids = list(range(self.next, self.next + self.gen))
        self.next += self.gen
        return Completion(text="", token_ids=ids, finish_reason="length", raw={"id": "x"})


async def _episode(mode: dict | None, turns: int = 4):
    rec = Recorder()
    sessions = TokenSessions(rec.complete, ClientError)
    sid = await sessions.open_session(compaction=mode)
    outs, stream = [], []
    for k in range(turns):
        append = [1, 2, 3] if k == 0 else [10 + k, 20 + k]  # the prompt, then observations
        out = await sessions.session_generate(sid, append, max_tokens=2, rewind_to=len(stream))
        stream += append + out.token_ids
        outs.append(out)
    return rec, outs, stream


async def test_without_compaction_every_call_sends_the_whole_stream_and_never_resets():
    rec, outs, stream = await _episode(None)
    assert rec.prompts[-1] == stream[: len(rec.prompts[-1])]
    assert all(len(a) < len(b) for a, b in zip(rec.prompts, rec.prompts[1:], strict=False))
    assert all("context_reset" not in o.raw for o in outs)
    assert outs[-1].raw["session_context"] == [[0, len(rec.prompts[-1])]]


async def test_markovian_resends_the_prompt_and_the_last_turn_and_reports_each_reset():
    rec, outs, stream = await _episode({"mode": "markovian", "n_protect_turns": 1})
    # turns start where each response began: 3, 7, 11, 15 (prompt 0-2, each turn 2 + 2)
    assert rec.prompts[0] == [1, 2, 3]
    assert rec.prompts[1] == stream[:7]  # one turn: nothing to drop yet
    assert "context_reset" not in outs[1].raw
    # the third call keeps the prompt and the turn being appended to (7-10)
    assert rec.prompts[2] == stream[:3] + stream[7:11]
    assert outs[2].raw["context_reset"] == {"start": 11, "context": [[0, 3], [7, 11]]}
    assert outs[3].raw["context_reset"] == {"start": 15, "context": [[0, 3], [11, 15]]}


async def test_turn_and_budget_compaction_are_refused_and_unknown_sessions_are_404():
    sessions = TokenSessions(Recorder().complete, ClientError)
    for mode in ({"mode": "turn"}, {"mode": "budget", "kv_budget": 64}):
        with pytest.raises(ValueError, match="allowed here \\['none', 'markovian'\\]"):
            await sessions.open_session(compaction=mode)
    with pytest.raises(ClientError) as lost:
        await sessions.session_generate("tok-9", [1], max_tokens=1)
    assert lost.value.status == 404


async def test_a_failed_call_leaves_the_session_as_it_was_and_rewind_cuts_it():
    rec = Recorder()
    fail = {"on": False}

    async def complete(prompt, **kw):
        if fail["on"]:
            raise ClientError("boom", status=503)
        return await rec.complete(prompt, **kw)

    sessions = TokenSessions(complete, ClientError)
    sid = await sessions.open_session()
    await sessions.session_generate(sid, [1, 2, 3], max_tokens=2)
    fail["on"] = True
    with pytest.raises(ClientError):
        await sessions.session_generate(sid, [7, 8], max_tokens=2, rewind_to=5)
    fail["on"] = False
    await sessions.session_generate(sid, [7, 8], max_tokens=2, rewind_to=5)
    assert rec.prompts[-1] == [1, 2, 3, 100, 101, 7, 8]
    assert (await sessions.rewind_session(sid, 3))["length"] == 3
    await sessions.session_generate(sid, [9], max_tokens=2)
    assert rec.prompts[-1] == [1, 2, 3, 9]


async def test_an_inference_client_with_client_sessions_keeps_them_itself():
    client = InferenceClient(ClientConfig("http://127.0.0.1:1", client_sessions=True))
    rec = Recorder()
    client.complete = rec.complete  # the completions a vLLM server would answer
    client._kept = TokenSessions(client.complete, ClientError)
    sid = await client.open_session(compaction={"mode": "markovian"})
    out = await client.session_generate(sid, [1, 2], max_tokens=2)
    assert rec.prompts == [[1, 2]] and out.token_ids == [100, 101]
    assert dataclasses.asdict(out)["raw"]["session_context"] == [[0, 2]]
    await client.close_session(sid)
    with pytest.raises(ClientError):
        await client.session_generate(sid, [3], max_tokens=1)
