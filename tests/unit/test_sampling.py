"""`serving.engine.sampling.sample` against a plain numpy reference: greedy rows, temperature,
top-k / top-p truncation (renormalised logprobs), ids past the tokenizer's vocabulary, the
top-K alternatives, per-row seeding that ignores the rest of the batch, and the empirical
distribution of the draws."""

import jax
import numpy as np
import pytest

from serving.engine.sampling import sample

VOCAB = 48  # the model's embedding rows
VALID = 40  # the tokenizer's tokens: ids 40..47 must never be drawn
K = 6

jit_sample = jax.jit(sample, static_argnames=("num_top", "valid_vocab"))


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_dist(logits, temperature, top_p, top_k, valid=VALID):
    """Log-probabilities a row is drawn from (-inf outside the kept set), as HF / vLLM
    define them: temperature, then top-k, then top-p on the renormalised top-k mass (keep the
    smallest prefix of the sorted tokens whose mass reaches top_p)."""
    logits = np.asarray(logits, np.float64)[:valid]
    if temperature == 0:
        return _log_softmax(logits)
    logp = _log_softmax(logits / temperature)
    order = sorted(range(valid), key=lambda i: -logp[i])
    if top_k > 0:
        order = order[:top_k]
    kept_logp = _log_softmax(logp[order])
    keep, mass = [], 0.0
    for i, lp in zip(order, kept_logp, strict=True):
        if mass >= top_p:
            break
        keep.append(i)
        mass += np.exp(lp)
    out = np.full(valid, -np.inf)
    out[keep] = _log_softmax(logp[keep])
    return out


ROWS = 8  # small batches are padded to one shape: one compile


def run(logits_BV, rows, num_top=VALID, valid=VALID):
    """`rows`: per row (temperature, top_p, top_k, seed, sample_index, counter)."""
    logits_BV = np.asarray(logits_BV, np.float32)
    n = len(rows)
    if n < ROWS:
        pad = ROWS - n
        logits_BV = np.concatenate([logits_BV, np.zeros((pad, logits_BV.shape[1]), np.float32)])
        rows = list(rows) + [(1.0, 1.0, 0, 0, 0, 0)] * pad
    t, p, k, s, i, c = (np.array(col) for col in zip(*rows, strict=True))
    out = jit_sample(
        logits_BV,
        t.astype(np.float32),
        p.astype(np.float32),
        k.astype(np.int32),
        s.astype(np.int32),
        i.astype(np.int32),
        c.astype(np.int32),
        num_top=num_top,
        valid_vocab=valid,
    )
    return [np.asarray(x)[:n] for x in out]


def make_logits(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = rng.normal(0.0, 2.0, (rows, VOCAB))
    logits[:, VALID:] = 50.0  # out-of-vocabulary rows would win every draw if they counted
    return logits.astype(np.float32)


# (temperature, top_p, top_k)
SETTINGS = [
    (0.0, 1.0, 0),
    (1.0, 1.0, 0),
    (0.7, 1.0, 0),
    (1.3, 1.0, 5),
    (1.0, 0.6, 0),
    (0.8, 0.9, 3),
    (1.0, 0.5, 8),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rows_match_the_reference_distribution(seed):
    logits = make_logits(len(SETTINGS), seed)
    rows = [(t, p, k, 11 + r, 0, seed) for r, (t, p, k) in enumerate(SETTINGS)]
    token, logprob, top_ids, top_lp = run(logits, rows)
    top_ids, top_lp = top_ids[:, :K], top_lp[:, :K]
    for r, (t, p, k) in enumerate(SETTINGS):
        ref = ref_dist(logits[r], t, p, k)
        tok = int(token[r])
        assert 0 <= tok < VALID
        assert np.isfinite(ref[tok]), f"row {r} drew token {tok} outside its kept set"
        assert logprob[r] == pytest.approx(ref[tok], abs=1e-5)
        if t == 0:
            assert tok == int(np.argmax(logits[r, :VALID]))
        # The top-K alternatives: sorted, the reference's best K, with their logprobs.
        assert all(a >= b for a, b in zip(top_lp[r][:-1], top_lp[r][1:], strict=True))
        want = np.argsort(-ref, kind="stable")[:K]
        finite = np.isfinite(ref[want])
        assert list(top_ids[r][finite]) == list(want[finite])
        np.testing.assert_allclose(top_lp[r][finite], ref[want][finite], atol=1e-5)
        assert np.all(top_lp[r][~finite] == -np.inf)


def test_truncated_logprobs_are_renormalised_over_the_kept_set():
    logits = make_logits(4, seed=5)
    rows = [
        (1.0, 1.0, 4, 1, 0, 0),
        (0.9, 1.0, 7, 2, 0, 0),
        (1.0, 0.3, 0, 3, 0, 0),
        (1.0, 0.8, 5, 4, 0, 0),
    ]
    token, logprob, top_ids, top_lp = run(logits, rows)
    for r, (t, p, k, *_) in enumerate(rows):
        ref = ref_dist(logits[r], t, p, k)
        kept = np.isfinite(top_lp[r])
        assert set(top_ids[r][kept].tolist()) == set(np.flatnonzero(np.isfinite(ref)).tolist())
        if k:
            assert kept.sum() <= k
        assert np.exp(top_lp[r][kept].astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-5)
        assert int(token[r]) in top_ids[r][kept]


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = make_logits(1, seed=9)
    argmax = int(np.argmax(logits[0, :VALID]))
    for seed in range(8):
        for t, p, k in [(1.0, 1.0, 1), (1.0, 1e-6, 0), (2.5, 1e-6, 0), (0.3, 1.0, 1)]:
            token, logprob, _, _ = run(logits, [(t, p, k, seed, 0, seed)])
            assert int(token[0]) == argmax
            assert logprob[0] == pytest.approx(0.0, abs=1e-6)  # the only token kept


def test_greedy_logprobs_are_the_untempered_model_logprobs():
    logits = make_logits(1, seed=4)
    token, logprob, top_ids, top_lp = run(logits, [(0.0, 0.5, 3, 0, 0, 0)])
    top_ids, top_lp = top_ids[:, :K], top_lp[:, :K]
    raw = _log_softmax(logits[0, :VALID])
    assert int(token[0]) == int(np.argmax(raw))
    assert logprob[0] == pytest.approx(raw.max(), abs=1e-5)
    np.testing.assert_allclose(top_lp[0], np.sort(raw)[::-1][:K], atol=1e-5)
    assert list(top_ids[0]) == list(np.argsort(-raw)[:K])


def test_a_row_draws_the_same_whatever_shares_the_batch():
    logits = make_logits(6, seed=3)
    mine = (0.9, 1.0, 0, 1234, 2, 17)
    alone = run(logits[:1], [mine])
    others = [
        (0.0, 1.0, 0, 0, 0, 0),
        (1.0, 0.2, 0, 5, 0, 3),
        (1.0, 1.0, 2, 6, 1, 0),
        (0.5, 0.7, 9, 7, 0, 1),
        (1.7, 1.0, 0, 8, 3, 9),
    ]
    for pos in (0, 3, 5):
        batch = others[:pos] + [mine] + others[pos:]
        rows = np.concatenate([logits[1 : pos + 1], logits[:1], logits[pos + 1 :]])
        together = run(rows, batch)
        assert int(together[0][pos]) == int(alone[0][0])
        assert together[1][pos] == pytest.approx(alone[1][0], abs=1e-6)


def test_seed_index_and_counter_select_the_random_stream():
    logits = np.zeros((1, VOCAB), np.float32)  # uniform over VALID: draws reveal the key
    logits[:, VALID:] = 50.0

    def draws(seed, index):
        out = []
        for start in range(0, 64, ROWS):
            rows = [(1.0, 1.0, 0, seed, index, c) for c in range(start, start + ROWS)]
            out += run(np.repeat(logits, ROWS, axis=0), rows)[0].tolist()
        return out

    assert draws(7, 0) == draws(7, 0)
    assert draws(7, 0) != draws(8, 0)
    assert draws(7, 0) != draws(7, 1)
    assert len(set(draws(7, 0))) > 20  # the counter advances the stream


@pytest.mark.parametrize(
    "t,p,k", [(1.0, 1.0, 0), (0.6, 1.0, 0), (1.0, 0.75, 0), (1.2, 1.0, 4), (1.0, 0.7, 3)]
)
def test_draws_follow_the_reference_distribution(t, p, k):
    n = 8192
    valid = 8
    base = np.array([1.5, 0.9, 0.4, 0.0, -0.3, -0.8, -1.4, -2.0, 40.0, 40.0], np.float32)
    rows = [(t, p, k, 99, 0, c) for c in range(n)]
    token = run(np.repeat(base[None], n, axis=0), rows, num_top=1, valid=valid)[0]
    ref = np.exp(ref_dist(base, t, p, k, valid=valid))
    counts = np.bincount(token, minlength=len(base))
    assert counts[valid:].sum() == 0
    assert np.all(counts[:valid][ref == 0] == 0)
    freq = counts[:valid] / n
    sigma = np.sqrt(ref * (1 - ref) / n)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-9), (freq, ref)


def test_an_all_greedy_batch_takes_the_fast_path_with_the_same_answers():
    """Every row greedy skips tempering and draws; each row's token, logprob and alternatives
    equal what the same row gets beside a sampled row (the mixed path)."""
    logits = make_logits(ROWS, seed=5)
    greedy_rows = [(0.0, 1.0, 0, r, 0, r) for r in range(ROWS)]
    fast = run(logits, greedy_rows)
    for r in range(ROWS):
        mixed = run(
            np.stack([logits[r], logits[(r + 1) % ROWS]]), [greedy_rows[r], (1.0, 1.0, 0, 3, 0, 0)]
        )
        assert int(fast[0][r]) == int(mixed[0][0]) == int(np.argmax(logits[r, :VALID]))
        # The two branches compile apart, so XLA may sum the log-softmax's VOCAB exps in
        # another order: each f32 add rounds by at most eps of the sum.
        tol = 2 * VOCAB * float(np.finfo(np.float32).eps)
        assert fast[1][r] == pytest.approx(float(mixed[1][0]), abs=tol)
        assert list(fast[2][r]) == list(mixed[2][0])
        np.testing.assert_allclose(fast[3][r], mixed[3][0], atol=tol)


def test_alternatives_are_skipped_when_no_row_wants_them():
    logits = make_logits(2, seed=6)
    rows = [(0.0, 1.0, 0, 0, 0, 0), (0.8, 0.9, 0, 1, 0, 0)]
    t, p, k, s, i, c = (np.array(col) for col in zip(*rows, strict=True))
    args = (
        logits,
        t.astype(np.float32),
        p.astype(np.float32),
        k.astype(np.int32),
        s.astype(np.int32),
        i.astype(np.int32),
        c.astype(np.int32),
    )
    with_top = jit_sample(*args, num_top=K, valid_vocab=VALID, want_top=True)
    without = jit_sample(*args, num_top=K, valid_vocab=VALID, want_top=False)
    for a, b in zip(with_top[:2], without[:2], strict=True):  # the same tokens and logprobs
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(without[2]) == 0) and np.all(np.isneginf(np.asarray(without[3])))
    assert np.all(np.isfinite(np.asarray(with_top[3])[0]))  # the greedy row: every id valid
