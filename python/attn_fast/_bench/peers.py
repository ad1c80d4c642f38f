"""Each implementation's callable for a case: attn_fast, the textbook NumPy code, torch's
scaled_dot_product_attention, onnxruntime's attention contrib ops (the last two optional)."""

from __future__ import annotations

import numpy as np

from .._config import set_num_threads
from ..functional import scaled_dot_product_attention
from . import common
from .common import numpy_textbook

IMPLS = ("attn_fast", "numpy", "torch", "onnxruntime")


class Skip(Exception):
    """A peer cannot run this case (not installed, unsupported, too big)."""


def _torch_view(x, torch):
    """A NumPy input as a torch tensor sharing its memory (bfloat16 bits as torch.bfloat16)."""
    if x.dtype == np.uint16:
        return torch.from_numpy(x.view(np.ndarray).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def prepare(impl, case, q, k, v, threads):
    """Return a zero-argument callable computing O as a (B, Hq, Lq, d) array."""
    group = case.Hq // case.Hkv
    if case.dtype != "fp32" and impl in ("numpy", "onnxruntime"):
        raise Skip("float32 only")
    if impl == "attn_fast":
        set_num_threads(threads)
        return lambda: scaled_dot_product_attention(
            q, k, v, is_causal=case.causal, enable_gqa=group > 1
        )
    if impl == "numpy":
        if case.B * case.Hq * case.Lq * case.Lk * 4 > (1 << 30):
            raise Skip("score matrix over 1 GiB")
        kk, vv = (np.repeat(x, group, axis=1) if group > 1 else x for x in (k, v))
        return lambda: numpy_textbook(q, kk, vv, case.causal)
    if impl == "torch":
        torch = common.import_peer("torch")
        if torch is None:
            raise Skip("torch not installed")
        torch.set_num_threads(threads)
        F = torch.nn.functional.scaled_dot_product_attention
        tq, tk, tv = (_torch_view(x, torch) for x in (q, k, v))
        kw = {"enable_gqa": True} if group > 1 else {}

        def run():
            with torch.no_grad():
                o = F(tq, tk, tv, is_causal=case.causal, **kw)
                return o.numpy() if case.dtype == "fp32" else o  # 16-bit: converted by check() only

        return run
    if impl == "onnxruntime":
        return _prepare_ort(case, q, k, v, threads)
    raise ValueError(impl)


def _bsh(x):
    """(B, H, L, d) -> contiguous (B, L, H*d), onnxruntime's layout."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1))


def _prepare_ort(case, q, k, v, threads):
    ort, onnx = common.import_peer("onnxruntime"), common.import_peer("onnx")
    if ort is None or onnx is None:
        raise Skip("onnxruntime/onnx not installed")
    from onnx import TensorProto, helper

    F = TensorProto.FLOAT
    ms = "com.microsoft"
    if case.Hq == case.Hkv and case.kind != "decode":
        node = helper.make_node(
            "MultiHeadAttention",
            ["q", "k", "v"],
            ["o"],
            domain=ms,
            num_heads=case.Hq,
            unidirectional=int(case.causal),
        )
        inputs = [helper.make_tensor_value_info(n, F, ["B", "L", case.Hq * case.d]) for n in "qkv"]
        outputs = [helper.make_tensor_value_info("o", F, None)]
        feed = {"q": _bsh(q), "k": _bsh(k), "v": _bsh(v)}
    else:
        # GroupQueryAttention is causal by definition; decode passes the cache
        # as past_key/past_value (Lk - 1 keys) plus the newest key, and the op
        # also writes the grown cache (present_key/value): ORT's decode API.
        if not case.causal and case.kind != "decode":
            raise Skip("GroupQueryAttention is causal only")
        hkv = case.Hkv * case.d
        decode = case.kind == "decode"
        names = [
            "q",
            "k",
            "v",
            "pk" if decode else "",
            "pv" if decode else "",
            "seqlens_k",
            "total_len",
        ]
        node = helper.make_node(
            "GroupQueryAttention",
            names,
            ["o", "present_k", "present_v"],
            domain=ms,
            num_heads=case.Hq,
            kv_num_heads=case.Hkv,
        )
        inputs = [
            helper.make_tensor_value_info("q", F, ["B", "S", case.Hq * case.d]),
            helper.make_tensor_value_info("k", F, ["B", "S", hkv]),
            helper.make_tensor_value_info("v", F, ["B", "S", hkv]),
        ]
        if decode:
            inputs += [
                helper.make_tensor_value_info(n, F, ["B", case.Hkv, "P", case.d])
                for n in ("pk", "pv")
            ]
        inputs += [
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
            helper.make_tensor_value_info("total_len", TensorProto.INT32, []),
        ]
        outputs = [
            helper.make_tensor_value_info(n, F, None) for n in ("o", "present_k", "present_v")
        ]
        L = case.Lk
        feed = {"seqlens_k": np.full(case.B, L - 1, np.int32), "total_len": np.array(L, np.int32)}
        if decode:
            feed.update(
                q=_bsh(q),
                k=_bsh(k[:, :, -1:]),
                v=_bsh(v[:, :, -1:]),
                pk=np.ascontiguousarray(k[:, :, :-1]),
                pv=np.ascontiguousarray(v[:, :, :-1]),
            )
        else:
            feed.update(q=_bsh(q), k=_bsh(k), v=_bsh(v))
    graph = helper.make_graph([node], "attn", inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)]
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    try:
        sess = ort.InferenceSession(
            model.SerializeToString(), so, providers=["CPUExecutionProvider"]
        )
    except Exception as e:  # noqa: BLE001 - an op this ORT build lacks is a skip
        raise Skip(f"onnxruntime: {str(e).splitlines()[0][:80]}") from None
    B, Lq, Hq, d = case.B, case.Lq, case.Hq, case.d
    return lambda: sess.run(["o"], feed)[0].reshape(B, Lq, Hq, d).transpose(0, 2, 1, 3)
