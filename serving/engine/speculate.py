"""Speculative decoding by prompt lookup (`EngineConfig.speculate`): a decoding sequence whose
last few tokens occurred earlier in its context (its prompt or its own completion) is guessed
to go on as it did then. One device call, `verify`, runs every slot's last token and its
guessed continuation at once, like a prompt chunk, samples at each position and keeps the
guesses up to the first one the model did not sample itself. A call then yields 1 to
`speculate + 1` tokens per slot for the weight reads of one decode step (on 2 CPU cores a 50M
model's 8 x 9-token verify costs two one-token steps: 58 vs 30 ms). It pays where outputs copy
their context (a file shown before, a command echoed, a loop).

The tokens are the ones plain decoding makes: position j of a call is sampled from the
logits after the tokens before it, with the key of the sequence's token `counter + j`
(`serving.engine.sampling`), and a guess is kept only when it is that sampled token, so the KV
written for it is the KV of the real next token. That holds for sampled requests too, not only
greedy ones (a sampled one's guesses are kept less often). Logits come from a chunked forward
instead of one token at a time: equal to float rounding.

The engine owns the `verify` call with its other jitted functions, and a `Speculator` that
decides, step by step, whether to make it. That is a cost estimate: the engine times `verify`
against each of its decode calls at warm-up (all slots active; `Speculator.calibrate`), and
verifies when the tokens the active slots are expected to yield per unit of cost beat the
decode call's. A sequence's guesses are scored on every planned step, decoded ones too, and
each guessed token is expected to hold with the rate of its sequence's confirmed guesses so
far (prior one half), given those before it held (`Lookup.expected`; the sequence keeps its
`Lookup`, so it lives with the other per-sequence state in `serving.engine.state`).
"""

from __future__ import annotations

import numpy as np

from serving.config import EngineConfig
from serving.engine.state import Lookup, Seq

__all__ = ["Lookup", "Speculator"]


class Speculator:
    """Guesses every decoding sequence's next tokens and chooses, per step, between a verify
    call and a decode call, and whether a decode call may be dispatched ahead. Counts
    `spec_steps`, `spec_guessed` and `spec_kept` in `stats`."""

    def __init__(self, cfg: EngineConfig, stats: dict[str, int]):
        self.cfg, self.stats = cfg, stats
        self.verify_cost: dict[int, float] = {}
        """Per decode call (its steps), seconds of a verify call per second of it."""
        self._hot, self._ahead_run = False, 0

    def calibrate(self, verify_s: float, decode_s: dict[int, float]) -> None:
        """The measured seconds of a verify call and of each decode call (by its steps)."""
        for steps, t in decode_s.items():
            self.verify_cost[steps] = verify_s / max(t, 1e-9)

    def inputs(
        self, decoding: list[Seq], tokens: np.ndarray, steps: int, lengths: np.ndarray
    ) -> tuple[np.ndarray, int]:
        """(inputs, steps) of the next call: a verify call's [B, K] inputs and its K tokens
        when verifying pays (`_guesses`), else the decode call's `tokens` and `steps` as
        given. `lengths`: the keys each slot holds."""
        guesses = self._guesses(decoding, steps, lengths)
        return (tokens, steps) if guesses is None else (guesses, guesses.shape[1])

    def ahead_ok(self) -> bool:
        """Whether a decode call may be dispatched ahead: never while guessing pays nearly
        enough, and at most 4 in a row (then a step is planned, and its guesses counted)."""
        self._ahead_run += 1
        return not self._hot and self._ahead_run <= 4

    def observe(self, decoding: list[Seq], start: dict[Seq, int], verified: bool) -> None:
        """Each sequence's guess of this step against the tokens it got (from `start`)."""
        for seq in decoding:
            if seq.guess is not None:  # set, with its lookup, by `_guesses`
                kept = seq.lookup.observe(seq.guess, seq.generated[start[seq] :])
                if verified:
                    self.stats["spec_guessed"] += len(seq.guess)
                    self.stats["spec_kept"] += kept
                seq.guess = None
        self.stats["spec_steps"] += verified

    def _guesses(self, decoding: list[Seq], steps: int, lengths: np.ndarray) -> np.ndarray | None:
        """Guess every decoding sequence's next tokens; [B, K] verify inputs (each slot's
        next input, then its guess) when the tokens the slots are expected to keep per unit
        of cost beat a `steps`-step decode's, else None."""
        self._hot, self._ahead_run = False, 0
        if not decoding:
            return None
        k = self.cfg.speculate
        tokens = np.zeros((self.cfg.num_slots, k + 1), np.int32)
        expected = 0.0
        for seq in decoding:
            if seq.lookup is None:
                sizes = tuple(range(self.cfg.speculate_ngram, 0, -1))
                seq.lookup = Lookup(sizes, list(seq.prompt))
            seq.guess = seq.lookup.guess(seq.generated, len(seq.prompt), k)
            tokens[seq.slot, 0] = seq.next_input
            tokens[seq.slot, 1 : 1 + len(seq.guess)] = seq.guess
            expected += 1 + seq.lookup.expected(len(seq.guess))
        bar = steps * len(decoding) * self.verify_cost.get(steps, 1.0)
        # Worth looking again next step, not dispatching a decode ahead blind (`ahead_ok`).
        self._hot = expected > bar / 2
        if expected <= bar:
            return None
        if any(lengths[s.slot] + k + 1 > self.cfg.max_seq_len for s in decoding):
            return None
        return tokens
