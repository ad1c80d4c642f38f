"""The oracle's own self-test: attn_fast.reference against triple loops."""

import math

import numpy as np

from attn_fast import reference as ref


def triple_loop_attention(q, k, v, visible):
    Lq, d = q.shape
    Lk, dv = v.shape
    out = np.zeros((Lq, dv))
    for i in range(Lq):
        scores = [
            sum(q[i, e] * k[j, e] for e in range(d)) / math.sqrt(d) if visible[i][j] else None
            for j in range(Lk)
        ]
        vis = [s for s in scores if s is not None]
        if not vis:
            continue
        m = max(vis)
        w = [math.exp(s - m) if s is not None else 0.0 for s in scores]
        tot = sum(w)
        for j in range(Lk):
            for e in range(dv):
                out[i, e] += w[j] / tot * v[j, e]
    return out


def test_oracle_matches_triple_loops(rng):
    for Lq, Lk, d, dv in [(1, 1, 1, 1), (4, 4, 3, 3), (5, 9, 2, 4), (9, 5, 3, 2)]:
        q, k, v = (
            rng.standard_normal((Lq, d)),
            rng.standard_normal((Lk, d)),
            rng.standard_normal((Lk, dv)),
        )
        for mask in (
            np.ones((Lq, Lk), bool),
            ref.causal_mask(Lq, Lk),
            ref.causal_mask(Lq, Lk, "top_left"),
        ):
            np.testing.assert_allclose(
                ref.sdpa(q, k, v, mask=mask), triple_loop_attention(q, k, v, mask), atol=1e-12
            )


def test_textbook_attention_is_sdpa(rng):
    X = rng.standard_normal((6, 8))
    Wq, Wk, Wv = (rng.standard_normal((3, 8)) for _ in range(3))
    for causal in (False, True):
        Q, K, V = X @ Wq.T, X @ Wk.T, X @ Wv.T
        mask = ref.causal_mask(6, 6) if causal else None
        np.testing.assert_allclose(
            ref.attention(X, Wq, Wk, Wv, causal), ref.sdpa(Q, K, V, mask=mask), atol=1e-12
        )


def test_oracle_fully_masked_rows_are_zero(rng):
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((5, 4)), rng.standard_normal((5, 2))
    mask = np.ones((3, 5), bool)
    mask[1] = False
    O, lse = ref.sdpa(q, k, v, mask=mask, return_lse=True)
    assert np.all(O[1] == 0) and lse[1] == -np.inf
    assert np.all(np.isfinite(O)) and np.isfinite(lse[0])


def test_oracle_softmax_rows_sum_to_one(rng):
    x = rng.standard_normal((7, 11)) * 50
    p = ref.softmax(x)
    np.testing.assert_allclose(p.sum(-1), 1.0)
    assert np.all(p >= 0)
