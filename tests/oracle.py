"""The float64 NumPy oracle of the tests.

The forward oracle is ``attn_fast.reference`` (``sdpa``, ``causal_mask``,
``window_mask``), re-exported here. Appended below: the textbook backward,
written as plainly as the forward (materialised S and P, explicit formulas).
Masks are dense boolean arrays (True = attend); ALiBi is passed as its
additive bias.
"""

from __future__ import annotations

import numpy as np

from attn_fast.reference import attention, causal_mask, sdpa, softmax, window_mask  # noqa: F401

# ---------------------------------------------------------------- backward


def sdpa_backward(
    q, k, v, dout, mask=None, bias=None, scale=None, softcap=None, sinks=None, out=None, lse=None
):
    """Textbook gradients of ``sdpa`` for (…, H, Lq, d) / (…, H_kv, Lk, d) / (…, H_kv, Lk, dv).

    Forward, materialised:
        S_raw = scale · Q Kᵀ;  T = tanh(S_raw / c), S = c · T   (softcap c, else S = S_raw)
        S += bias;  S = -inf where not mask
        lse = log(Σ_j exp(S) + exp(sink));  P = exp(S − lse);  O = P V
    Backward, for an upstream gradient dO:
        dV = Pᵀ dO
        dP = dO Vᵀ
        D  = rowsum(dO ∘ O)
        dS = P ∘ (dP − D)           then  dS_raw = dS ∘ (1 − T²) under softcap
        dQ = scale · dS_raw K,   dK = scale · dS_rawᵀ Q
        dsink_h = −Σ_rows exp(sink_h − lse) · D
    GQA: K, V are repeated over the group for the forward; dK, dV are summed
    over the group. ``out`` / ``lse`` given: P and D use them (ring attention:
    a global out and lse with a block of the keys). Returns dict dq, dk, dv
    (and dsinks when sinks are given).
    """
    q, k, v, dout = (np.asarray(a, dtype=np.float64) for a in (q, k, v, dout))
    Hq, Hkv = q.shape[-3], k.shape[-3]
    g = Hq // Hkv
    K = np.repeat(k, g, axis=-3)
    V = np.repeat(v, g, axis=-3)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    S = (q @ np.swapaxes(K, -1, -2)) * scale
    T = None
    if softcap:
        T = np.tanh(S / softcap)
        S = softcap * T
    if bias is not None:
        bias = np.asarray(bias, dtype=np.float64)
        S = np.where(np.isneginf(bias), -np.inf, S + bias)
    visible = np.ones(S.shape, bool)
    if mask is not None:
        visible = np.broadcast_to(np.asarray(mask, dtype=bool), S.shape)
    if bias is not None:
        visible = visible & ~np.isneginf(bias)
    S = np.where(visible, S, -np.inf)
    if lse is None or out is None:
        O_, lse_ = _forward(S, V, sinks)
        out = O_ if out is None else out
        lse = lse_ if lse is None else lse
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)[..., None]
    live = np.isfinite(lse) | np.isnan(lse)
    with np.errstate(invalid="ignore", over="ignore"):
        P = np.where(visible & live, np.exp(S - np.where(live, lse, 0.0)), 0.0)
    dV = np.swapaxes(P, -1, -2) @ dout
    dP = dout @ np.swapaxes(V, -1, -2)
    D = np.sum(dout * out, axis=-1, keepdims=True)
    dS = P * (dP - D)
    if T is not None:
        dS = dS * (1 - T * T)
    dQ = scale * (dS @ K)
    dK = scale * (np.swapaxes(dS, -1, -2) @ q)
    shp = dK.shape[:-3] + (Hkv, g) + dK.shape[-2:]
    res = {
        "dq": dQ,
        "dk": dK.reshape(shp).sum(axis=-3),
        "dv": dV.reshape(dV.shape[:-3] + (Hkv, g) + dV.shape[-2:]).sum(axis=-3),
    }
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64).reshape(-1, 1, 1)
        p_sink = np.where(live, np.exp(sk - np.where(live, lse, 0.0)), 0.0)  # (…, H, Lq, 1)
        ds = -(p_sink * D)[..., 0]  # (…, H, Lq)
        res["dsinks"] = ds.sum(axis=-1).reshape(-1, Hq).sum(axis=0)
    return res


def _forward(S, V, sinks):
    """O and lse from masked scores S (-inf = masked), with optional sinks."""
    m = S.max(axis=-1, keepdims=True, initial=-np.inf)
    if sinks is not None:
        sk = np.asarray(sinks, dtype=np.float64).reshape(-1, 1, 1)
        m = np.maximum(m, np.broadcast_to(sk, m.shape))
    dead = np.isneginf(m)
    m0 = np.where(dead, 0.0, m)
    E = np.exp(S - m0)
    l = E.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sk - m0)
    with np.errstate(divide="ignore", invalid="ignore"):
        P = np.where(l == 0, 0.0, E / l)
        lse = np.where(l == 0, -np.inf, m0 + np.log(l))[..., 0]
    return P @ V, lse
