"""The decode fast paths equal the checked paths: the same bits, the same errors.

Fast paths (issue 38): ``scaled_dot_product_attention`` with a plan of a plain
call (``functional._PLANS``), ``KVCache.attend`` with the key of its last
checked query (``_plan_key``), the torch op's direct call (``_direct_ok``) and
the transformers backend built on them. Each test runs a call twice: once on
the checked path (plans cleared / fast path switched off), once on the fast
path (a plan from a first call with other data of the same layout), and asks
for identical outputs, then for identical exceptions on bad input after a plan
exists. Every result is also checked against the float64 oracle.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from helpers import randn, tol
from oracle import causal_mask, sdpa, window_mask

import attn_fast as af
from attn_fast import _checks
from attn_fast import functional as F

torch = pytest.importorskip("torch")


def _fresh(a):
    """A new array (other memory) holding other values of `a`'s shape, dtype and strides."""
    b = np.empty_like(a)  # keeps the layout of a C- or F-ordered array
    b[...] = a[::-1] if a.shape[0] > 1 else -a
    if b.strides != a.strides:  # a view: rebuild the same view on new memory
        b = np.lib.stride_tricks.as_strided(np.empty_like(a.base), a.shape, a.strides)
        b[...] = -a
    return b


def _checked(fn, *args, **kw):
    """fn(*args, **kw) with every plan of the functional layer cleared (the checked path)."""
    F._PLANS.clear()
    return fn(*args, **kw)


def _count_checks(monkeypatch):
    """A list that grows by one per call of check_qkv (the checked path's first step)."""
    calls = []
    real = F.check_qkv

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(F, "check_qkv", counting)
    return calls


# ---------------------------------------------------------------- scaled_dot_product_attention

CASES = [
    # (B, Hq, Hkv, Lq, Lk, d, is_causal): decode shapes on both sides of DECODE_MIN_LK
    # (the tiled kernel below it, the split-KV kernel above), prefill, odd sizes.
    (1, 9, 3, 1, 16, 64, False),
    (1, 9, 3, 1, 129, 64, False),
    (2, 4, 2, 1, 600, 80, True),
    (1, 2, 1, 3, 70, 5, True),
    (2, 3, 3, 7, 7, 1, True),
    (1, 4, 2, 1, 1, 256, False),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_sdpa_plan_same_bits(isa, rng, monkeypatch, case, dtype):
    B, Hq, Hkv, Lq, Lk, d, causal = case
    q = randn(rng, (B, Hq, Lq, d), dtype)
    k = randn(rng, (B, Hkv, Lk, d), dtype)
    v = randn(rng, (B, Hkv, Lk, d), dtype)
    args = dict(is_causal=causal, enable_gqa=Hkv != Hq)
    ref = _checked(af.scaled_dot_product_attention, q, k, v, **args)
    calls = _count_checks(monkeypatch)
    F._PLANS.clear()
    af.scaled_dot_product_attention(_fresh(q), _fresh(k), _fresh(v), **args)  # builds the plan
    assert len(calls) == 1
    got = af.scaled_dot_product_attention(q, k, v, **args)
    assert len(calls) == 1, "the second call of the same key should take the plan"
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert np.array_equal(got, ref, equal_nan=True)
    mask = causal_mask(Lq, Lk) if causal else None
    want = sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask=mask)
    t = tol(np.float32) if dtype == np.float16 else tol(dtype)
    if dtype == np.float16:
        t = dict(rtol=5e-3, atol=5e-3)
    np.testing.assert_allclose(got.astype(np.float64), want, **t)


@pytest.mark.parametrize("layout", ["transposed", "strided", "fortran"])
def test_sdpa_plan_non_contiguous(rng, monkeypatch, layout):
    from helpers import relayout

    q, k, v = (
        relayout(randn(rng, s), layout) for s in ((1, 8, 1, 16), (1, 2, 300, 16), (1, 2, 300, 16))
    )
    ref = _checked(af.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    calls = _count_checks(monkeypatch)
    got = af.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert not calls
    assert np.array_equal(got, ref)
    np.testing.assert_allclose(got, sdpa(q, k, v), **tol(np.float32))


def test_sdpa_plan_key_separates_layouts(rng, monkeypatch):
    """A plan of one layout is not used for another (the key holds the strides and kinds).
    Two query rows: a one-row decode plan serves every k / v layout (its own test below)."""
    q, k, v = randn(rng, (1, 4, 2, 8)), randn(rng, (1, 4, 100, 8)), randn(rng, (1, 4, 100, 8))
    F._PLANS.clear()
    af.scaled_dot_product_attention(q, k, v)
    calls = _count_checks(monkeypatch)
    af.scaled_dot_product_attention(q, np.asfortranarray(k), v)
    af.scaled_dot_product_attention(q, k, v, is_causal=True)
    af.scaled_dot_product_attention(q, k, v, scale=0.5)
    af.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v))
    assert len(calls) == 4


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sdpa_plan_torch_tensors(rng, monkeypatch, dtype):
    """Torch tensors take plans of their own (keys from their NumPy views, bfloat16 as its
    bits): the same bits as the checked path, a tensor of the input's dtype back, and a
    NumPy call of the same layout does not take a tensor's plan."""
    dt = getattr(torch, dtype)
    q, k, v = (
        torch.from_numpy(randn(rng, s)).to(dt)
        for s in ((1, 6, 1, 16), (1, 2, 90, 16), (1, 2, 90, 16))
    )
    ref = _checked(af.scaled_dot_product_attention, q, k, v, enable_gqa=True)
    calls = _count_checks(monkeypatch)
    F._PLANS.clear()
    af.scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), enable_gqa=True)
    got = af.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert len(calls) == 1, "the second call of the same key should take the plan"
    assert type(got) is torch.Tensor and got.dtype == dt
    assert torch.equal(got, ref)
    if dtype != "bfloat16":
        af.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True)
        assert len(calls) == 2


@pytest.fixture(params=["dlpack", "attributes"])
def tensor_reader(request):
    """How _core reads a tensor in C: by torch's DLPack exchange table (one C call) or by
    its Python attributes (a torch without the table); both give the same views and
    refuse the same tensors."""
    _checks._is_torch_tensor(torch.zeros(1))  # torch's kinds handed over (once per process)
    table = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if request.param == "dlpack" and table is None:
        pytest.skip("this torch has no DLPack exchange table (__dlpack_c_exchange_api__)")
    _checks._hand_torch_to_core(dlpack=request.param == "dlpack")
    yield request.param
    _checks._hand_torch_to_core()


TENSOR_LAYOUTS = {
    # name: (q, k, v) from contiguous q (1, 6, 3, 16) and k, v (1, 2, 40, 16)
    "contiguous": lambda q, k, v: (q, k, v),
    "transposed_k": lambda q, k, v: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v),
    "sliced": lambda q, k, v: (q[..., :2, :], k[:, :, 3:], v[:, :, 3:]),
    "broadcast_kv": lambda q, k, v: (q, k[:, :, :1].expand(k.shape), v[:, :, :1].expand(v.shape)),
}


@pytest.mark.parametrize("layout", sorted(TENSOR_LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_tensor_plan_in_c_same_bits(isa, rng, tensor_reader, layout, dtype):
    """_core.run_plan runs the plan a checked call on tensors stored (found by the
    same key) and returns what that call returns: the same bits, a new tensor of q's
    dtype and shape, C-contiguous; None until a plan exists."""
    dt = getattr(torch, dtype)
    base = [
        torch.from_numpy(randn(rng, s)).to(dt)
        for s in ((1, 6, 3, 16), (1, 2, 40, 16), (1, 2, 40, 16))
    ]
    q, k, v = TENSOR_LAYOUTS[layout](*base)
    for is_causal, scale in ((False, None), (True, 0.3)):
        F._PLANS.clear()
        assert F._core.run_plan(F._PLANS, q, k, v, is_causal, True, scale) is None
        _checks._is_torch_tensor(q)  # the tensor type known (a first call only learns it)
        ref = F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, enable_gqa=True, scale=scale
        )
        got = F._core.run_plan(F._PLANS, q, k, v, is_causal, True, scale)
        assert got is not None, "the checked call's plan should be found by the C key"
        assert type(got) is torch.Tensor and got.dtype == dt and got.shape == ref.shape
        assert got.is_contiguous() and got.data_ptr() != ref.data_ptr()
        assert torch.equal(got, ref)
        other = 0.5 if scale is None else None  # another scale: another key
        assert F._core.run_plan(F._PLANS, q, k, v, is_causal, True, other) is None
        assert F._core.run_plan(F._PLANS, q, k, v, not is_causal, True, scale) is None
    want = sdpa(
        *(t.double().numpy() for t in (q, k, v)),
        scale=0.3,
        mask=causal_mask(q.shape[2], k.shape[2]),
    )
    t = 2e-4 if dtype == "float32" else 1e-9 if dtype == "float64" else 3e-2
    np.testing.assert_allclose(got.double().numpy(), want, rtol=t, atol=t)


def _strided_nested(k):
    """k's heads as a nested tensor of torch's strided layout (an exact torch.Tensor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "prototype stage"
        return torch.nested.nested_tensor(list(k[0]))


def _tensor_refusals():
    """(name, q, k, v transform, context) the C plan must refuse (None) once a plan of the
    same layout exists: each differs from a planned call only in what the key does not
    hold."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class FunctionPass(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    import contextlib

    none = contextlib.nullcontext
    refusals = {
        "k_requires_grad": (lambda q, k, v: (q, k.clone().requires_grad_(), v), none),
        "q_negative_bit": (lambda q, k, v: (torch._neg_view(q), k, v), none),
        "v_parameter": (lambda q, k, v: (q, k, torch.nn.Parameter(v.clone())), none),
        "k_meta": (lambda q, k, v: (q, k.to("meta"), v), none),
        "k_sparse": (lambda q, k, v: (q, k.to_sparse(), v), none),
        "k_zero_tensor": (lambda q, k, v: (q, torch._efficientzerotensor(k.shape), v), none),
        "k_nested": (lambda q, k, v: (q, _strided_nested(k), v), none),
        "k_int32": (lambda q, k, v: (q, k.to(torch.int32), v), none),
        "k_complex": (lambda q, k, v: (q, k.to(torch.complex64), v), none),
        "k_float8": (lambda q, k, v: (q, k.to(torch.float8_e4m3fn), v), none),
        "k_bool": (lambda q, k, v: (q, k > 0, v), none),
        "dispatch_mode": (lambda q, k, v: (q, k, v), Passthrough),
        "function_mode": (lambda q, k, v: (q, k, v), FunctionPass),
    }
    if torch.backends.mkldnn.is_available():
        refusals["k_mkldnn"] = (lambda q, k, v: (q, k.float().to_mkldnn(), v), none)
    return refusals


@pytest.mark.parametrize("which", sorted(_tensor_refusals()))
def test_tensor_plan_in_c_refuses(rng, tensor_reader, which):
    """What the key does not hold (grad, the negative bit, subclasses, devices, layouts,
    torch's modes) is read per call: such tensors never take a plan in C, and the public
    call takes the checked path (which refuses a negative-bit view)."""
    make, ctx = _tensor_refusals()[which]
    q, k, v = (
        torch.from_numpy(randn(rng, s)) for s in ((1, 6, 1, 16), (1, 2, 40, 16), (1, 2, 40, 16))
    )
    F._PLANS.clear()
    for _ in range(2):  # a process's first tensor call may only learn the tensor type
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert F._core.run_plan(F._PLANS, q, k, v, False, True, None) is not None
    bq, bk, bv = make(q, k, v)
    with ctx():
        assert F._core.run_plan(F._PLANS, bq, bk, bv, False, True, None) is None
    if which == "q_negative_bit":  # the checked path reads its values, not the memory
        got = F.scaled_dot_product_attention(bq, k, v, enable_gqa=True)
        assert torch.equal(got, F.scaled_dot_product_attention(-q, k, v, enable_gqa=True))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_negative_bit_views_are_read_as_their_values(rng, dtype):
    """torch._neg_view / conj views hold their values lazily: every entry point reads the
    values (a copy), as for -x; an out= with the bit is refused (its memory is not its
    values, so results written there would be lost)."""
    import attn_fast.torch as aft

    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(s, dtype=dt) for s in ((1, 6, 1, 16), (1, 2, 40, 16), (1, 2, 40, 16)))
    nq, nk = torch._neg_view(q), torch._neg_view(k)
    for _ in range(3):  # the checked call, then the plans
        want = F.scaled_dot_product_attention(-q, -k, v, enable_gqa=True)
        assert torch.equal(F.scaled_dot_product_attention(nq, nk, v, enable_gqa=True), want)
        assert torch.equal(aft.scaled_dot_product_attention(nq, nk, v, enable_gqa=True), want)
    a, b = (af.KVCache(1, 2, 16, dtype=dtype) for _ in range(2))
    a.append(nk, v)
    b.append(-k, v)
    assert torch.equal(a.attend(nq), b.attend(-q))
    with pytest.raises(TypeError, match="out is a torch view with a lazy negation"):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True, out=torch._neg_view(-q))


NUMPY_LAYOUTS = {
    "contiguous": lambda q, k, v: (q, k, v),
    "fortran_k": lambda q, k, v: (q, np.asfortranarray(k), v),
    "sliced": lambda q, k, v: (q[..., :2, :], k[:, :, 3:], v[:, :, 3:]),
    "broadcast_kv": lambda q, k, v: (
        q,
        np.broadcast_to(k[:, :, :1], k.shape),
        np.broadcast_to(v[:, :, :1], v.shape),
    ),
}


@pytest.mark.parametrize("layout", sorted(NUMPY_LAYOUTS))
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_numpy_plan_in_c_same_bits(isa, rng, layout, dtype):
    """The same for NumPy arrays: _core.run_plan finds the checked call's plan by
    plan_key's bytes and returns a new array with its bits; refused arrays give None."""
    base = [randn(rng, s).astype(dtype) for s in ((1, 6, 3, 16), (1, 2, 40, 16), (1, 2, 40, 16))]
    q, k, v = NUMPY_LAYOUTS[layout](*base)
    run = F._core.run_plan
    for is_causal, scale in ((False, None), (True, 0.3)):
        F._PLANS.clear()
        assert run(F._PLANS, q, k, v, is_causal, True, scale) is None
        ref = F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, enable_gqa=True, scale=scale
        )
        got = run(F._PLANS, q, k, v, is_causal, True, scale)
        assert type(got) is np.ndarray and got.dtype == ref.dtype == q.dtype
        assert got.flags.c_contiguous and not np.shares_memory(got, ref)
        np.testing.assert_array_equal(got, ref)
        assert run(F._PLANS, q, k, v, not is_causal, True, scale) is None
    big = q.astype(q.dtype.newbyteorder(">"))  # the same values, another byte order
    assert run(F._PLANS, big, k, v, True, True, 0.3) is None
    raw = np.ndarray(q.shape, q.dtype, buffer=np.empty(q.nbytes + 1, np.uint8), offset=1)
    raw[...] = q
    assert not raw.flags.aligned
    assert run(F._PLANS, raw, k, v, True, True, 0.3) is None
    sub = q.view(type("Sub", (np.ndarray,), {}))
    assert run(F._PLANS, sub, k, v, True, True, 0.3) is None
    want = sdpa(
        *(x.astype(np.float64) for x in (q, k, v)),
        scale=0.3,
        mask=causal_mask(q.shape[2], k.shape[2]),
    )
    t = 2e-4 if dtype == "float32" else 1e-9 if dtype == "float64" else 3e-2
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=t, atol=t)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_tensor_views_are_the_numpy_views(rng, tensor_reader, dtype):
    """_core.tensor_views gives what fast_view gives: the tensors' memory (no copy), their
    shapes and byte strides, bfloat16 as uint16 bits, each view keeping its tensor alive;
    None for what the key of a plan could not tell apart."""
    dt = getattr(torch, dtype)
    base = torch.from_numpy(randn(rng, (2, 3, 9, 8))).to(dt)
    ts = (base, base[:, :, 2:7].transpose(2, 3), base[:, :1].expand(2, 3, 9, 8))
    _checks._is_torch_tensor(base)  # torch's kinds handed to _core
    views = F._core.tensor_views(*ts)
    for t, got in zip(ts, views):
        want = _checks.fast_view(t)[0]
        assert type(got) is np.ndarray and got.dtype == want.dtype
        assert got.shape == want.shape and got.strides == want.strides
        assert got.ctypes.data == t.data_ptr() and got.base is t
        np.testing.assert_array_equal(got, want)
    empty = torch.zeros((1, 2, 0, 8), dtype=dt)  # no memory at all (data_ptr() 0)
    for got in F._core.tensor_views(empty, empty, empty):
        assert got.shape == (1, 2, 0, 8) and not got.flags.owndata and got.base is empty
    for name, (make, _ctx) in _tensor_refusals().items():
        if name in ("dispatch_mode", "function_mode"):  # modes: the caller's question
            continue
        assert F._core.tensor_views(*make(*ts)) is None, name


def test_tensor_plan_in_c_other_inputs(rng):
    """A tensor's plan serves tensors only; other inputs and arguments the key cannot hold
    give None."""
    q, k, v = randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 9, 8)), randn(rng, (1, 2, 9, 8))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    F._PLANS.clear()
    for _ in range(2):  # a process's first tensor call may only learn the tensor type
        F.scaled_dot_product_attention(tq, tk, tv)
    run = F._core.run_plan
    assert run(F._PLANS, tq, tk, tv, False, False, None) is not None
    assert run(F._PLANS, q, k, v, False, False, None) is None  # NumPy: plans of their own
    assert run(F._PLANS, tq, tk, [1.0], False, False, None) is None
    assert run(F._PLANS, tq, tk, tv, False, False, 1) is None  # an int scale: not a key
    assert run(F._PLANS, tq, tk, tv.int(), False, False, None) is None


def _bad_inputs(rng):
    """(name, q, k, v, kwargs) calls that must raise, each close to a planned plain call."""
    q, k, v = randn(rng, (1, 4, 1, 8)), randn(rng, (1, 2, 100, 8)), randn(rng, (1, 2, 100, 8))
    bad = [
        ("no_gqa_flag", q, k, v, {}),
        ("k_float64", q, k.astype(np.float64), v, dict(enable_gqa=True)),
        ("k_head_dim", q, randn(rng, (1, 2, 100, 6)), v, dict(enable_gqa=True)),
        ("v_length", q, k, randn(rng, (1, 2, 99, 8)), dict(enable_gqa=True)),
        ("is_causal_int", q, k, v, dict(enable_gqa=True, is_causal=1)),
        ("scale_nan", q, k, v, dict(enable_gqa=True, scale=float("nan"))),
        ("scale_huge", q, k, v, dict(enable_gqa=True, scale=1e300)),
        ("scale_str", q, k, v, dict(enable_gqa=True, scale="0.1")),
        ("dropout", q, k, v, dict(enable_gqa=True, dropout_p=0.1)),
        ("q_int", q.astype(np.int32), k, v, dict(enable_gqa=True)),
        ("q_list", q.tolist(), k, v, dict(enable_gqa=True)),
        ("heads", randn(rng, (1, 3, 1, 8)), k, v, dict(enable_gqa=True)),
        ("k_grad", torch.from_numpy(q), torch.from_numpy(k).requires_grad_(), None, {}),
    ]
    return (q, k, v), bad


@pytest.mark.parametrize("which", range(13))
def test_sdpa_plan_same_errors(rng, which):
    (q, k, v), bad = _bad_inputs(rng)
    name, bq, bk, bv, kw = bad[which]
    if bv is None:  # torch inputs: the matching torch v
        bv = torch.from_numpy(v)
    F._PLANS.clear()
    with pytest.raises(Exception) as checked:
        af.scaled_dot_product_attention(bq, bk, bv, **kw)
    # Plans for the good call and for every layout of the bad call's arrays that exist.
    af.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if not isinstance(bq, list):
        try:
            af.scaled_dot_product_attention(bq, k, v, enable_gqa=True)
        except Exception:  # noqa: BLE001 - the bad q alone may be refused too
            pass
    with pytest.raises(Exception) as fast:
        af.scaled_dot_product_attention(bq, bk, bv, **kw)
    assert type(fast.value) is type(checked.value), name
    assert str(fast.value) == str(checked.value), name


def _layouts(rng):
    """Arrays of one shape in several dtypes and layouts, and ones the C key refuses."""
    base = randn(rng, (1, 2, 5, 8))
    keyed = [
        base,
        base.copy(),  # equal fields, other memory: the same key
        base.astype(np.float64),
        base.astype(np.float16),
        np.asfortranarray(base),
        randn(rng, (1, 5, 2, 8)).transpose(0, 2, 1, 3),
        randn(rng, (1, 2, 5, 16))[..., ::2],
        randn(rng, (1, 2, 6, 8))[:, :, :5],
        randn(rng, (2, 5, 8)),
    ]
    raw = np.zeros(base.nbytes + 1, np.uint8)
    refused = [
        base.astype(">f4"),  # not native byte order
        raw[1:].view(np.float32).reshape(base.shape),  # not aligned
        base.astype(np.int32),
        base.view(np.recarray),  # a subclass
        torch.from_numpy(base),
        base.tolist(),
    ]
    return keyed, refused


def _fields(q, k, v, out, is_causal, enable_gqa, scale):
    """What a plan key must tell apart: the flags, the scale and each array's dtype, shape
    and strides."""
    arrays = (q, k, v) if out is None else (q, k, v, out)
    return (is_causal, enable_gqa, scale) + tuple((a.dtype, a.shape, a.strides) for a in arrays)


def test_sdpa_plan_c_key_matches_the_fields(rng):
    """_core.plan_key's bytes are equal exactly when the fields are (every flag, scale,
    dtype, shape and stride), and None for what is not an exact, aligned, native float
    ndarray (those take fast_view's views, or the checked path)."""
    keyed, refused = _layouts(rng)
    opts = [(False, False, None), (True, False, None), (False, True, None), (False, False, 0.5)]
    opts.append((False, False, -0.0))  # C: its own bits; Python: -0.0 == 0.0 (both checked)
    calls = [(a, b, o, f) for a in keyed for b in keyed[:3] for o in (None, keyed[0]) for f in opts]
    c_keys = [af._core.plan_key(a, b, b, o, *f) for a, b, o, f in calls]
    py_keys = [_fields(a, b, b, o, *f) for a, b, o, f in calls]
    assert all(type(c) is bytes for c in c_keys)
    for i in range(len(calls)):
        for j in range(len(calls)):
            same_scale_bits = np.signbit(calls[i][3][2] or 0) == np.signbit(calls[j][3][2] or 0)
            assert (c_keys[i] == c_keys[j]) == (py_keys[i] == py_keys[j] and same_scale_bits)
    for x in refused:
        assert af._core.plan_key(x, keyed[0], keyed[0], None, False, False, None) is None
        assert af._core.plan_key(keyed[0], keyed[0], keyed[0], x, False, False, None) is None
    assert af._core.plan_key(keyed[0], keyed[0], keyed[0], None, False, False, 1) is None
    deep = np.zeros((1,) * 9, np.float32)
    assert af._core.plan_key(deep, deep, deep, None, False, False, None) is None


def test_sdpa_plan_refused_layouts_take_the_checked_path(rng, monkeypatch):
    """Arrays the C key refuses are computed by the checked path every time (or by the
    Python key's plan, for torch tensors), with the same bits as a fresh checked call."""
    _, refused = _layouts(rng)
    k = randn(rng, (1, 2, 5, 8))
    for x in refused[:2]:
        ref = _checked(af.scaled_dot_product_attention, x, k, k)
        calls = _count_checks(monkeypatch)
        got = [af.scaled_dot_product_attention(x, k, k) for _ in range(2)]
        assert len(calls) == 2
        monkeypatch.undo()
        for g in got:
            assert np.array_equal(g, ref)


def test_sdpa_plan_bounded():
    F._PLANS.clear()
    q = np.zeros((1, 1, 1, 4), np.float32)
    for L in range(1, F._MAX_PLANS + 10):
        kv = np.zeros((1, 1, L, 4), np.float32)
        af.scaled_dot_product_attention(q, kv, kv)
    assert 0 < len(F._PLANS) <= F._MAX_PLANS


# ---------------------------------------------------------------- KVCache.attend


def _cache_run(cache_args, steps, rng, dtype=np.float32, Hq=6, torch_q=False, fast=True):
    """Outputs of a decode loop (append one token, attend) after a prompt; fast=False
    forgets the plan before each attend (the checked path every time)."""
    B, Hkv, d = cache_args["batch"], cache_args["num_kv_heads"], cache_args["head_dim"]
    c = af.KVCache(**cache_args)
    P = steps[0]
    k0, v0 = randn(rng, (B, Hkv, P, d), dtype), randn(rng, (B, Hkv, P, d), dtype)
    c.append(k0, v0)
    outs = []
    for t in steps[1:]:
        k1, v1 = randn(rng, (B, Hkv, t, d), dtype), randn(rng, (B, Hkv, t, d), dtype)
        q = randn(rng, (B, Hq, t, d), dtype)
        c.append(k1, v1)
        if not fast:
            c._plan_key = None
        qq = torch.from_numpy(q) if torch_q else q
        o = c.attend(qq)
        outs.append(np.asarray(o))
    return outs


@pytest.mark.parametrize(
    "cache_args",
    [
        dict(batch=1, num_kv_heads=3, head_dim=64, capacity=64),
        dict(batch=2, num_kv_heads=2, head_dim=5, capacity=16),
        dict(batch=1, num_kv_heads=2, head_dim=80, window=20),  # a ring that wraps
    ],
)
@pytest.mark.parametrize("torch_q", [False, True])
def test_kv_cache_fast_same_bits(isa, rng, cache_args, torch_q):
    steps = [7, 1, 1, 1, 3, 1, 1, 129, 1]
    seed = int(rng.integers(1 << 30))
    got = _cache_run(cache_args, steps, np.random.default_rng(seed), torch_q=torch_q)
    ref = _cache_run(cache_args, steps, np.random.default_rng(seed), torch_q=torch_q, fast=False)
    for g, r in zip(got, ref):
        assert np.array_equal(g, r)


def test_kv_cache_fast_against_oracle(isa, rng):
    B, Hkv, Hq, d, w = 1, 2, 4, 16, 9
    c = af.KVCache(B, Hkv, d, window=w)
    ks, vs = [], []
    for _ in range(30):
        k, v = randn(rng, (B, Hkv, 1, d)), randn(rng, (B, Hkv, 1, d))
        ks.append(k)
        vs.append(v)
        c.append(k, v)
        q = randn(rng, (B, Hq, 1, d))
        o = c.attend(q)
        K, V = np.concatenate(ks, 2), np.concatenate(vs, 2)
        L = K.shape[2]
        want = sdpa(q, K, V, mask=window_mask(1, L, w - 1, 0))
        np.testing.assert_allclose(o, want, **tol(np.float32))


def test_kv_cache_fast_16bit_torch(isa, rng):
    B, Hkv, Hq, d = 2, 2, 4, 32
    outs = []
    for fast in (True, False):
        r = np.random.default_rng(5)
        c = af.KVCache(B, Hkv, d, dtype="bfloat16")
        res = []
        for t in (100, 1, 1, 1):
            k = torch.from_numpy(randn(r, (B, Hkv, t, d))).bfloat16()
            v = torch.from_numpy(randn(r, (B, Hkv, t, d))).bfloat16()
            q = torch.from_numpy(randn(r, (B, Hq, t, d))).bfloat16()
            c.append(k, v)
            if not fast:
                c._plan_key = None
            o = c.attend(q)
            assert o.dtype == torch.bfloat16
            res.append(o.float().numpy())
        outs.append(res)
    for g, r in zip(*outs):
        assert np.array_equal(g, r)


def test_kv_cache_fast_same_errors(rng):
    """After a plan exists, bad queries and lost keys raise exactly what the checked path does."""

    def make():
        c = af.KVCache(1, 2, 8, window=4, ring=4, growable=False)
        c.append(randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 1, 8)))
        return c

    q = randn(rng, (1, 4, 1, 8))
    bad_q = [
        q.astype(np.float64),
        randn(rng, (1, 3, 1, 8)),
        randn(rng, (1, 4, 1, 6)),
        randn(rng, (2, 4, 1, 8)),
        q[0],
        q.tolist(),
    ]
    for bq in bad_q:
        errs = []
        for planned in (False, True):
            c = make()
            if planned:
                c.attend(q)
            with pytest.raises(Exception) as e:
                c.attend(bq)
            errs.append((type(e.value), str(e.value)))
        assert errs[0] == errs[1]

    # Rows the cache cannot serve, with a plan for that very query shape: more query rows
    # than stored keys (after truncate), and keys a window ring has dropped.
    def short(c, q3):
        c.truncate(1)

    def dropped(c, q3):
        for _ in range(3):
            c.append(randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 1, 8)))

    for lose, L in ((short, 3), (dropped, 6)):
        errs = []
        for planned in (False, True):
            c = af.KVCache(1, 2, 8, window=4, ring=8, growable=False)
            for _ in range(L):
                c.append(randn(rng, (1, 2, 1, 8)), randn(rng, (1, 2, 1, 8)))
            qL = randn(rng, (1, 4, L, 8))
            if planned:
                c.attend(qL)
                assert c._plan_key is not None
            lose(c, qL)
            with pytest.raises(ValueError) as e:
                c.attend(qL)
            errs.append(str(e.value))
        assert errs[0] == errs[1]
    for planned in (False, True):  # scale checked on the checked path, also with a plan
        c = make()
        if planned:
            c.attend(q)
        with pytest.raises(ValueError, match="overflows"):
            c.attend(q, scale=1e300)


# ---------------------------------------------------------------- the torch op


@pytest.mark.parametrize("shape", [(1, 9, 3, 1, 16, 64), (1, 8, 2, 1, 300, 32), (2, 4, 4, 5, 9, 7)])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
def test_torch_direct_same_bits(isa, rng, monkeypatch, shape, dtype):
    import attn_fast.torch as aft

    B, Hq, Hkv, Lq, Lk, d = shape
    dt = getattr(torch, dtype)
    q, k, v = (
        torch.from_numpy(randn(rng, s)).to(dt)
        for s in ((B, Hq, Lq, d), (B, Hkv, Lk, d), (B, Hkv, Lk, d))
    )
    for causal in (False, True):
        with torch.no_grad():
            assert aft._direct_ok((q, k, v))
            aft.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            got = aft.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            monkeypatch.setattr(aft, "_planned_call", lambda *a: None)
            direct = aft.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            monkeypatch.setattr(aft, "_direct_ok", lambda ts: False)
            ref = aft.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            monkeypatch.undo()
        assert got.dtype == direct.dtype == ref.dtype == dt
        assert torch.equal(got, ref) and torch.equal(direct, ref)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True
        )
        t = 1e-9 if dt == torch.float64 else 2e-4 if dt == torch.float32 else 3e-2
        torch.testing.assert_close(got.double(), want, rtol=t, atol=t)


def test_torch_direct_not_when_grad_or_tracing(rng):
    import attn_fast.torch as aft

    q = torch.from_numpy(randn(rng, (1, 2, 1, 4)))
    assert aft._direct_ok((q, q, None))
    g = q.clone().requires_grad_()
    assert not aft._direct_ok((g, q))
    with torch.no_grad():
        assert aft._direct_ok((g, q))
    assert not aft._direct_ok((torch.nn.Parameter(q.clone()), q))  # a subclass

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert not aft._direct_ok((q,))

    # Autograd through the op still works (the direct call is never taken with grad).
    k = torch.from_numpy(randn(rng, (1, 2, 5, 4))).requires_grad_()
    out = aft.scaled_dot_product_attention(g, k, k)
    out.sum().backward()
    assert g.grad is not None and k.grad is not None


@pytest.mark.parametrize(
    "bad",
    [
        lambda q: (q, q.double(), q),
        lambda q: (q, q[..., :3], q),
        lambda q: (q.int(), q, q),
        lambda q: (q, torch.cat([q, q, q], 1), torch.cat([q, q, q], 1)),
    ],
)
def test_torch_direct_same_errors(rng, monkeypatch, bad):
    import attn_fast.torch as aft

    q = torch.from_numpy(randn(rng, (1, 2, 1, 4)))
    args = bad(q)
    errs = []
    good = (q, torch.cat([q, q], 2), torch.cat([q, q], 2))
    aft.scaled_dot_product_attention(*good)  # a plan: the C path is tried first
    assert aft._planned_call(F._PLANS, *good, False, False, None) is not None
    for direct in (True, False):
        monkeypatch.setattr(aft, "_direct_ok", lambda ts, d=direct: d)
        with torch.no_grad(), pytest.raises(Exception) as e:
            aft.scaled_dot_product_attention(*args)
        errs.append((type(e.value), str(e.value)))
    assert errs[0] == errs[1]


def test_sdpa_plan_with_out(rng, monkeypatch):
    """out= (a transposed torch view, as the transformers backend passes it): same bits, the
    caller's object back; an out that aliases q is filled through a temporary; a read-only
    out raises what the checked path raises."""
    q, k, v = randn(rng, (2, 6, 1, 8)), randn(rng, (2, 3, 40, 8)), randn(rng, (2, 3, 40, 8))
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))
    bufs = [torch.full((2, 1, 6, 8), float("nan")) for _ in range(3)]
    F._PLANS.clear()
    ref = af.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    calls = _count_checks(monkeypatch)
    for buf in bufs:
        o = buf.transpose(1, 2)
        got = af.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True, out=o)
        assert got is o
        assert torch.equal(o, ref)
    assert len(calls) == 1  # the first out= call planned, the next two took the plan

    a = randn(rng, (1, 2, 1, 8))
    expect = sdpa(a, a, a)
    for _ in range(2):  # checked, then planned
        x = a.copy()
        af.scaled_dot_product_attention(x, x, x, out=x)
        np.testing.assert_allclose(x, expect, **tol(np.float32))

    errs = []
    for planned in (False, True):
        F._PLANS.clear()
        o = np.empty((2, 6, 1, 8), np.float32)
        if planned:
            af.scaled_dot_product_attention(q, k, v, enable_gqa=True, out=o)
        o.flags.writeable = False
        with pytest.raises(ValueError) as e:
            af.scaled_dot_product_attention(q, k, v, enable_gqa=True, out=o)
        errs.append(str(e.value))
    assert errs[0] == errs[1] and "read-only" in errs[0]


# ---------------------------------------------------------------- the short-context rule


@pytest.mark.parametrize("Lq", [1, 2, 4])
@pytest.mark.parametrize("Lk", [1, 7, 63, 64, 129])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_row_decodes_at_any_length(isa, rng, Lq, Lk, dtype):
    """One query row takes the decode kernel at every Lk, 2 to 4 rows from DECODE_MIN_LK
    keys on; either side of the rule matches the oracle (causal and not, GQA)."""
    from attn_fast import _dispatch as D
    from attn_fast.masks import MaskArgs

    kernel = D.choose_kernel(Lq=Lq, Lk=Lk, mask=MaskArgs())
    want_decode = Lq == 1 or Lk >= D.DECODE_MIN_LK
    assert kernel == (D.DECODE if want_decode else D.PREFILL)
    q, k = randn(rng, (2, 6, Lq, 80), dtype), randn(rng, (2, 2, Lk, 80), dtype)
    v = randn(rng, (2, 2, Lk, 80), dtype)
    for causal in (False, True):
        got = af.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        forced = af.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True, backend="decode" if want_decode else "fused"
        )
        assert np.array_equal(got, forced)
        mask = causal_mask(Lq, Lk) if causal else None
        np.testing.assert_allclose(got, sdpa(q, k, v, mask=mask), **tol(dtype))


def test_kv_cache_append_fast_same_state_and_errors(rng):
    """append with the key of its last checked chunks skips the checks: the same storage and
    outputs as checking every chunk; bad chunks raise what the checked path raises."""
    caches = [af.KVCache(2, 2, 8, capacity=4) for _ in range(2)]
    for t in range(12):
        k, v, q = randn(rng, (2, 2, 1, 8)), randn(rng, (2, 2, 1, 8)), randn(rng, (2, 4, 1, 8))
        outs = []
        for i, c in enumerate(caches):
            if i == 1:
                c._append_key = c._plan_key = None  # the checked path every step
            c.append(torch.from_numpy(k) if t % 2 else k, v)
            outs.append(c.attend(q))
        assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(caches[0]._k, caches[1]._k)
    assert np.array_equal(caches[0]._v, caches[1]._v)
    good = randn(rng, (2, 2, 1, 8))
    for bad_k, bad_v in [
        (good.astype(np.float64), good),
        (randn(rng, (2, 2, 1, 6)), good),
        (good, randn(rng, (2, 2, 2, 8))),
        (randn(rng, (1, 2, 1, 8)), good),
        (good.tolist(), good),
    ]:
        errs = []
        for planned in (False, True):
            c = af.KVCache(2, 2, 8)
            if planned:
                c.append(good, good)
                assert c._append_key is not None
            with pytest.raises(Exception) as e:
                c.append(bad_k, bad_v)
            errs.append((type(e.value), str(e.value)))
        assert errs[0] == errs[1]


def _one_row_inputs(rng, kind, dtype):
    """q (1, 6, 1, 16) and a (1, 2, 300, 16) K / V buffer, as NumPy arrays or tensors."""
    q, kb, vb = (randn(rng, s) for s in ((1, 6, 1, 16), (1, 2, 300, 16), (1, 2, 300, 16)))
    if kind == "numpy":
        return tuple(x.astype(dtype) for x in (q, kb, vb))
    return tuple(torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, kb, vb))


ONE_ROW_KV = {  # (k, v) of Lk keys in other layouts than the planning call's
    "prefix": lambda kb, vb, L: (kb[:, :, :L], vb[:, :, :L]),
    "contiguous": lambda kb, vb, L: (
        (kb[:, :, :L].copy(), vb[:, :, :L].copy())
        if isinstance(kb, np.ndarray)
        else (kb[:, :, :L].clone(), vb[:, :, :L].clone())
    ),
    "reversed": lambda kb, vb, L: (
        (kb[:, :, L - 1 :: -1], vb[:, :, L - 1 :: -1])
        if isinstance(kb, np.ndarray)
        else (kb[:, :, :L].flip(2), vb[:, :, :L].flip(2))
    ),
    "broadcast": lambda kb, vb, L: (
        (kb[:, :, :1].expand(-1, -1, L, -1), vb[:, :, :L])
        if not isinstance(kb, np.ndarray)
        else (np.broadcast_to(kb[:, :, :1], (1, 2, L, 16)), vb[:, :, :L])
    ),
}


@pytest.mark.parametrize("kind,dtype", [("numpy", "float32"), ("numpy", "float64"),
                                        ("numpy", "float16"), ("torch", "float32"),
                                        ("torch", "bfloat16")])  # fmt: skip
@pytest.mark.parametrize("is_causal", [False, True])
def test_one_row_plan_serves_every_lk(isa, rng, kind, dtype, is_causal):
    """A one-row decode call's plan serves later calls with another key count and other
    k / v strides (a cache grown by a token): run_plan's result is the checked path's bits
    (out= keeps a call on the checked path) at every Lk and layout."""
    q, kb, vb = _one_row_inputs(rng, kind, dtype)
    F._PLANS.clear()
    for _ in range(2):  # the checked call stores the plan (a first tensor call may only learn)
        F.scaled_dot_product_attention(q, kb[:, :, :7], vb[:, :, :7], is_causal=is_causal,
                                       enable_gqa=True)  # fmt: skip
    run = F._core.run_plan
    for L in (1, 2, 63, 64, 65, 129, 300):
        for layout, make in ONE_ROW_KV.items():
            k, v = make(kb, vb, L)
            got = run(F._PLANS, q, k, v, is_causal, True, None)
            assert got is not None, (L, layout)
            out = np.empty_like(got) if kind == "numpy" else torch.empty_like(got)
            F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True, out=out)
            if kind == "numpy":
                np.testing.assert_array_equal(got, out)
            else:
                assert torch.equal(got, out), (L, layout)


def test_one_row_plan_declines(rng):
    """What the one-row key does not cover takes the checked path: two query rows (whose
    kernel depends on Lk), k / v of different key counts (the checked path's ValueError),
    no key, another flag, scale, dtype or head count."""
    q, kb, vb = _one_row_inputs(rng, "numpy", "float32")
    F._PLANS.clear()
    F.scaled_dot_product_attention(q, kb[:, :, :9], vb[:, :, :9], enable_gqa=True)
    run = F._core.run_plan
    assert run(F._PLANS, q, kb[:, :, :20], vb[:, :, :20], False, True, None) is not None
    q2 = np.concatenate([q, q], axis=2)
    F.scaled_dot_product_attention(q2, kb[:, :, :9], vb[:, :, :9], enable_gqa=True)
    assert run(F._PLANS, q2, kb[:, :, :9], vb[:, :, :9], False, True, None) is not None
    assert run(F._PLANS, q2, kb[:, :, :90], vb[:, :, :90], False, True, None) is None
    for k, v, flags in (
        (kb[:, :, :20], vb[:, :, :21], (False, True, None)),
        (kb[:, :, :0], vb[:, :, :0], (False, True, None)),
        (kb[:, :, :20], vb[:, :, :20], (True, True, None)),
        (kb[:, :, :20], vb[:, :, :20], (False, True, 0.5)),
        (kb[:, :, :20].astype(np.float64), vb[:, :, :20], (False, True, None)),
        (kb[:, :1, :20], vb[:, :1, :20], (False, True, None)),
    ):
        assert run(F._PLANS, q, k, v, *flags) is None
    with pytest.raises(ValueError):
        F.scaled_dot_product_attention(q, kb[:, :, :20], vb[:, :, :21], enable_gqa=True)


def test_lk_free_key_covers_one_row_calls_only(rng):
    """lk_free_key: equal for one-row calls that differ only in Lk and k / v strides (and
    b"t" kept for tensor keys); None for out=, two rows, other ranks, or no key count."""
    q, kb, vb = _one_row_inputs(rng, "numpy", "float32")

    def key(q, k, v, out=None, bits16=False):
        return F._core.plan_key(q, k, v, out, False, True, None, bits16)

    free = F._core.lk_free_key
    a = free(key(q, kb[:, :, :5], vb[:, :, :5]))
    assert a is not None and a == free(key(q, kb[:, :, :200].copy(), vb[:, :, 7:207]))
    assert a != free(key(q, kb[:, :, :5].astype(np.float64), vb[:, :, :5]))
    assert free(b"t" + key(q, kb[:, :, :5], vb[:, :, :5])) == b"t" + a
    assert free(key(q, kb[:, :, :5], vb[:, :, :5], out=np.empty_like(q))) is None
    assert free(key(np.concatenate([q, q], 2), kb[:, :, :5], vb[:, :, :5])) is None
    assert free(key(q[0], kb[0, :, :5], vb[0, :, :5])) is None
    assert free(key(q, kb[:, :, :0], vb[:, :, :0])) is None
    assert free(b"") is None and free(b"x" * 17) is None
