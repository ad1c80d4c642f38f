"""The typed seam between Python and the kernels (attn_fast._dispatch).

MaskArgs records and their merge, the one place the kernel is chosen, the
one out= helper and the unified checkers of _checks.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import numpy as np
import oracle as ref
import pytest
from conftest import poisoned, tol

import attn_fast as af
from attn_fast import _checks, _core, _dispatch
from attn_fast import masks as M
from attn_fast._dispatch import DECODE, PREFILL, REFERENCE, ScoreArgs
from attn_fast.masks import MaskArgs

B, H = 2, 3


def random_args(rng, Lq, Lk):
    """MaskArgs of random parts: causal, a window, lengths, a layout, a mask, a bias.

    Aligned top-left: the diagonal then does not move with the lengths, so
    the merge is exactly the element-wise AND of the parts' visibilities
    (bottom-right, each sequence's lengths set its diagonal: see masks.Padding).
    """
    parts = [
        M.Causal("top_left"),
        M.SlidingWindow(int(rng.integers(0, 9)), int(rng.integers(0, 5)), "top_left"),
        M.Padding(rng.integers(0, Lk + 1, B), rng.integers(0, Lq + 1, B)),
        M.BlockSparse(rng.random((H, -(-Lq // 4), -(-Lk // 6))) < 0.7, 4, 6),
        M.Dense(rng.random((B, 1, Lq, Lk)) < 0.8),
        M.Dense(np.where(rng.random((Lq, Lk)) < 0.1, -np.inf, rng.standard_normal((Lq, Lk)))),
    ]
    pick = rng.random(len(parts)) < 0.5
    return [
        p.kernel_args(B=B, H=H, Lq=Lq, Lk=Lk, dtype=np.float64) for p, k in zip(parts, pick) if k
    ]


@pytest.mark.parametrize("Lq, Lk", [(1, 1), (7, 7), (7, 129), (129, 33)])
def test_merge_is_the_intersection(rng, Lq, Lk):
    for _ in range(20):
        parts = random_args(rng, Lq, Lk) + random_args(rng, Lq, Lk)
        merged = MaskArgs.combine(parts, B, Lq, Lk)
        want = np.ones((B, H, Lq, Lk), bool)
        for p in parts:
            want &= M.visibility(p, B, H, Lq, Lk)
        got = np.broadcast_to(M.visibility(merged, B, H, Lq, Lk), want.shape)
        np.testing.assert_array_equal(got, want)


def test_merge_rules_field_by_field():
    a = MaskArgs(window_left=5, kv_lens=np.array([3, 9]), aligns=frozenset({"bottom_right"}))
    b = MaskArgs(causal=True, window_left=2, window_right=4, kv_lens=np.array([7, 4]))
    m = a.merge(b)
    assert m.causal and (m.window_left, m.window_right) == (2, 4)
    np.testing.assert_array_equal(m.kv_lens, [3, 4])
    assert m.q_lens is None and m.aligns == {"bottom_right"}
    assert a.window_left == 5 and not a.causal  # merge makes a new record
    bias1, bias2 = np.ones((1, 1, 2, 3)), np.full((1, 1, 2, 3), 2.0)
    s = MaskArgs(bias=bias1).merge(MaskArgs(bias=bias2))
    np.testing.assert_array_equal(s.bias, 3.0)
    lay1 = np.broadcast_to(np.array([[1, 0], [1, 1]], np.uint8), (1, 1, 2, 2))
    lay2 = np.broadcast_to(np.ones((1, 1, 3, 3), np.uint8), (1, 1, 3, 3))
    g = MaskArgs(layout=lay1, layout_bq=4, layout_bk=4).merge(
        MaskArgs(layout=lay2, layout_bq=2, layout_bk=2)
    )
    assert (g.layout_bq, g.layout_bk) == (2, 2)  # the gcd, each block refined
    np.testing.assert_array_equal(g.layout[0, 0], [[1, 1, 0], [1, 1, 0], [1, 1, 1]])


def test_mask_args_is_frozen_and_set_fields_names_what_is_set():
    m = MaskArgs(causal=True, q_lens=np.array([1]), aligns=frozenset({"top_left"}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.causal = False
    assert m.set_fields() == ["causal", "q_lens", "top_left"]
    assert MaskArgs().set_fields() == [] and not MaskArgs().elementwise
    assert ScoreArgs(softcap=1.0, sinks=np.zeros(2)).set_fields() == ["softcap", "sinks"]


def test_alignment_conflict_resolved_only_where_it_coincides():
    tl = MaskArgs(causal=True, aligns=frozenset({"top_left"}))
    br = MaskArgs(causal=True, aligns=frozenset({"bottom_right"}))
    assert MaskArgs.combine([tl, br], 2, 5, 5).aligns == {"bottom_right"}
    with pytest.raises(ValueError, match="bottom-right and top-left"):
        MaskArgs.combine([tl, br], 2, 5, 6)
    padded = MaskArgs(q_lens=np.array([5, 3]), kv_lens=np.array([5, 5]))
    with pytest.raises(ValueError, match="padded lengths differ"):
        MaskArgs.combine([tl, padded, br], 2, 5, 5)  # found only once the lengths are in
    assert MaskArgs.combine([tl], 2, 5, 6).top_left


@pytest.mark.parametrize(
    "kw, want",
    [
        (dict(Lq=1, Lk=64), DECODE),
        (dict(Lq=4, Lk=4096), DECODE),
        (dict(Lq=5, Lk=4096), PREFILL),
        (dict(Lq=1, Lk=63), DECODE),  # one query row: the decode kernel at any Lk
        (dict(Lq=2, Lk=63), PREFILL),
        (dict(Lq=1, Lk=63, keys=_dispatch.KEYS_CACHE), DECODE),
        (dict(Lq=64, Lk=63, keys=_dispatch.KEYS_CACHE), PREFILL),
        (dict(Lq=64, Lk=63, keys=_dispatch.KEYS_RING), DECODE),
        (dict(Lq=1, Lk=4096, stats=True), PREFILL),
        (dict(Lq=1, Lk=4096, same_batch=False), PREFILL),
        (dict(Lq=1, Lk=4096, block_sizes=(0, 16)), PREFILL),
        (dict(Lq=1, Lk=4096, packed=True), PREFILL),
        (dict(Lq=1, Lk=4096, score=ScoreArgs(softcap=3.0)), PREFILL),
        (dict(Lq=1, Lk=4096, mask=MaskArgs(bias=np.zeros((1, 1, 1, 1)))), PREFILL),
        (dict(Lq=1, Lk=4096, backend="reference"), REFERENCE),
        (dict(Lq=900, Lk=9, backend="decode"), DECODE),
    ],
)
def test_choose_kernel(kw, want):
    kw.setdefault("mask", MaskArgs(causal=True, kv_lens=np.array([3])))
    assert _dispatch.choose_kernel(**kw) == want


def test_forced_decode_names_what_it_lacks():
    with pytest.raises(ValueError, match=r"backend='decode'.*\['alibi', 'causal', 'mask'\]"):
        _dispatch.choose_kernel(
            Lq=1,
            Lk=9,
            mask=MaskArgs(causal=True, mask=np.ones((1, 1, 1, 9), np.uint8)),
            score=ScoreArgs(alibi=np.ones(1)),
            backend="decode",
        )


@pytest.fixture
def kernel_calls(monkeypatch):
    """The _core entry points each public call reached, in order."""
    seen = []
    for name in ("forward", "decode", "backward"):
        real = getattr(_core, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(_core, name, spy)
    return seen


def test_public_calls_reach_the_kernel_choose_kernel_picks(rng, kernel_calls):
    q, k, v = (rng.standard_normal((1, 2, L, 8)) for L in (1, 100, 100))
    af.scaled_dot_product_attention(q, k, v, is_causal=True)
    af.scaled_dot_product_attention(q, k, v, attn_mask=np.ones((1, 100), bool))
    q2 = rng.standard_normal((1, 2, 2, 8))
    af.scaled_dot_product_attention(q2, k[:, :, :9], v[:, :, :9])  # 2 rows, few keys: tiled
    af.scaled_dot_product_attention(q, k[:, :, :9], v[:, :, :9])  # one row: decode at any Lk
    cache = af.KVCache(1, 2, 8, capacity=32, dtype=np.float64)
    kc, vc = rng.standard_normal((2, 1, 2, 9, 8))
    cache.append(kc, vc)
    cache.attend(rng.standard_normal((1, 2, 9, 8)))  # prefill-sized chunk
    cache.append(kc[:, :, :1], vc[:, :, :1])
    cache.attend(q)  # a decode step against 10 keys
    assert kernel_calls == ["decode", "forward", "forward", "decode", "forward", "decode"]


def test_only_the_dispatch_module_calls_the_attention_kernels():
    pkg = pathlib.Path(af.__file__).parent
    callers = set()
    for path in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("forward", "decode", "backward")
                and isinstance(node.value, ast.Name)
                and node.value.id == "_core"
            ):
                callers.add(path.name)
    assert callers == {"_dispatch.py"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_output_helper_aliasing_and_kind(rng, dtype):
    q, k, v = (rng.standard_normal((2, 3, 7, 5)).astype(dtype) for _ in range(3))
    want = ref.sdpa(q, k, v)
    res = _checks.Output.prepare(None, (2, 3, 7, 5), np.dtype(dtype), like=q, reads=(q,))
    assert res.out is None and res.target is None and res.array.flags.c_contiguous
    o = q.copy()
    got = af.scaled_dot_product_attention(o, k, v, out=o)  # out is the input q
    assert got is o
    np.testing.assert_allclose(o, want, **tol(dtype))
    buf = poisoned((2, 3, 7, 5), dtype)
    res = _checks.Output.prepare(buf, buf.shape, buf.dtype, like=q, reads=(q, k))
    assert res.array is buf and res.target is None
    res.array[...] = 1.0
    out, lse = res.result(np.zeros(3))
    assert out is buf and np.all(buf == 1.0) and isinstance(lse, np.ndarray)


def test_one_error_class_and_one_int_checker():
    assert M.MaskTypeError is _checks.ArgumentTypeError
    for call in (
        lambda: M.SlidingWindow(2.5),
        lambda: M.BlockSparse(np.ones((2, 2), bool), 1.5),
        lambda: af.scaled_dot_product_attention(
            np.ones((4, 2)), np.ones((4, 2)), np.ones((4, 2)), block_q=2.5
        ),
        lambda: M.Padding(np.array([1.0, 2.0])).kernel_args(B=2, H=1, Lq=4, Lk=4, dtype=np.float64),
    ):
        with pytest.raises(TypeError, match="must be an integer|must hold integers") as e:
            call()
        assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match=r"block_q must be in \[0, 4096\], got 4097"):
        _checks.check_int(4097, "block_q", 0, 4096)


@pytest.mark.parametrize(
    "x, match",
    [
        (
            np.array([1, 2, 3]),
            r"lens must have one length per batch entry, shape \(2,\), got shape \(3,\)",
        ),
        (np.array([-1, 2]), r"lens must lie in \[0, 5\], got values in \[-1, 2\]"),
        (np.array([6, 2]), r"lens must lie in \[0, 5\]"),
        (np.array([2**63 + 1, 0], np.uint64), "beyond int64"),
    ],
)
def test_check_seq_lens_errors(x, match):
    with pytest.raises(ValueError, match=match):
        _checks.check_seq_lens(x, "lens", 2, 5)


def test_check_seq_lens_values():
    a = _checks.check_seq_lens(np.int32(4), "lens", 3, 5)
    assert a.dtype == np.int64 and a.tolist() == [4, 4, 4]
    src = np.array([1, 2], np.uint8)
    b = _checks.check_seq_lens(src, "lens", 2)
    assert b.dtype == np.int64 and not np.shares_memory(b, src)


def test_check_qkv_one_checker_for_every_caller():
    x = np.ones((2, 3, 5, 4), np.float32)
    got = _checks.check_qkv(x, x[:, :1], x[:, :1], enable_gqa=True)
    assert got.dims == (2, 3, 1, 5, 5, 4, 4) and got.q4.shape == (2, 3, 5, 4)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        _checks.check_qkv(x, x[:, :1], x[:, :1])
    with pytest.raises(ValueError, match="batch and heads must match"):
        _checks.check_qkv(x, x[:, :1], x[:, :1], enable_gqa=None)
    with pytest.raises(ValueError, match="batch, heads and length must match"):
        _checks.check_qkv(x, x[:, :, :2], x[:, :, :2], enable_gqa=None, same_len=True)
    with pytest.raises(ValueError, match="same number of dimensions"):
        _checks.check_qkv(x, x[0], x[0])
    with pytest.raises(TypeError, match="float32 or float64, got dtype float16"):
        _checks.check_qkv(x.astype(np.float16), x, x)
    assert _checks.check_qkv(x[0, 0], x[0, 0], None, half=True).v4 is None


def binding_params(fn):
    """The parameter names pybind11 wrote on the first line of fn's docstring."""
    line = fn.__doc__.strip().splitlines()[0]
    return [a.arg for a in ast.parse(f"def {line}: ...").body[0].args.args]


@pytest.mark.parametrize("binding, lead", [(_core.forward, 6), (_core.backward, 11)])
def test_kernel_args_follow_the_bindings_order(binding, lead):
    # _kernel_args turns the records into the bindings' positional mask arguments:
    # each value lands on the parameter of its own name.
    lens, lay, dense, bias = np.array([3, 4]), np.ones((1, 1, 1, 1), np.uint8), object(), object()
    mask = MaskArgs(True, 5, 2, lens, lens[::-1], lay, 7, 9, dense, bias, frozenset({"top_left"}))
    score = ScoreArgs(2.5, np.ones(3), np.zeros(3))
    cu_q, cu_k = np.array([0, 1]), np.array([0, 2])
    got = _dispatch._kernel_args(mask, score, cu_q, cu_k, 16, 32)
    names = binding_params(binding)[lead : lead + len(got)]
    source = {**vars(mask), **vars(score), "top_left": True}
    source.update(cu_q=cu_q, cu_k=cu_k, block_q=16, block_k=32)
    assert len(names) == len(got) == 18
    for name, value in zip(names, got):
        assert value is source[name] or (type(value) is not np.ndarray and value == source[name])


def test_positional_call_equals_the_keyword_call(rng):
    # The record path and the binding's keyword form run the same kernel on the same bits.
    q = rng.standard_normal((2, 4, 9, 16)).astype(np.float32)
    k = rng.standard_normal((2, 2, 11, 16)).astype(np.float32)
    v = rng.standard_normal((2, 2, 11, 8)).astype(np.float32)
    lens = np.array([11, 6], np.int64)
    alibi = np.linspace(0.1, 0.4, 4).astype(np.float32)
    mask = MaskArgs(causal=True, window_left=4, kv_lens=lens, aligns=frozenset({"top_left"}))
    o1, o2 = np.empty((2, 4, 9, 8), np.float32), np.empty((2, 4, 9, 8), np.float32)
    score = ScoreArgs(softcap=3.0, alibi=alibi)
    _dispatch.attend(PREFILL, q, k, v, o1, None, scale=0.3, mask=mask, score=score)
    _core.forward(
        q,
        k,
        v,
        o2,
        scale=0.3,
        causal=True,
        top_left=True,
        window_left=4,
        kv_lens=lens,
        softcap=3.0,
        alibi=alibi,
    )
    assert np.array_equal(o1, o2) and np.isfinite(o1).all()
    with pytest.raises(ValueError, match="scale is required"):
        _core.forward(q, k, v, o2)


def test_merged_records_equal_constructed_ones():
    a = MaskArgs(causal=True, aligns=frozenset({"bottom_right"}))
    b = MaskArgs(kv_lens=np.array([5]))
    m = a.merge(b)
    assert type(m) is MaskArgs and dataclasses.is_dataclass(m)
    want = MaskArgs(causal=True, kv_lens=b.kv_lens, aligns=a.aligns)
    assert {f.name: getattr(m, f.name) for f in dataclasses.fields(m)} == {
        f.name: getattr(want, f.name) for f in dataclasses.fields(want)
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.window_left = 3
