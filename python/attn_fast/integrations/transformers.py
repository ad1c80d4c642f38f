"""attn_fast as a Hugging Face transformers attention backend.

    import attn_fast.integrations.transformers as af_hf
    af_hf.register()                                   # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="attn_fast")
    # or, on a loaded model: model.set_attn_implementation("attn_fast")

Every attention call of the model then runs through
``attn_fast.scaled_dot_product_attention`` on the CPU: padded batches,
causal prefill, one-token decode against transformers' own KV cache,
grouped-query attention (K/V are never repeated), sliding-window layers,
Gemma-2 style ``softcap`` and gpt-oss style sinks (``s_aux``).

What ``register()`` installs, and why both halves are needed
------------------------------------------------------------
1. ``AttentionInterface["attn_fast"] = attention_forward``: the function every
   attention module calls with query (B, H, Lq, d), key/value (B, H_kv, Lk, d),
   the layer's mask, ``scaling``, ``dropout`` and model-specific keywords; it
   returns the output in (B, Lq, H, dv) layout and ``None`` for the weights.

2. ``AttentionMaskInterface["attn_fast"] = attention_mask``: the mask builder
   transformers' ``create_causal_mask`` & co. call. Without one, transformers
   builds *no mask at all* for an unknown implementation name (it assumes a
   paged/external backend), so padding would be silently ignored.

The mask builder follows transformers' ``sdpa`` rules, so that every mask the
attention function receives means exactly what it means for ``"sdpa"``:

- ``None`` only where the sdpa builder would also skip it and where the
  alignment of the causal mask cannot matter (Lq == 1 or Lq == Lk, no padding,
  no effective window): the attention function then applies the module's
  ``is_causal`` flag.

- Otherwise the dense boolean (B, 1, Lq, Lk) mask (True = attend), built by
  transformers' own ``sdpa_mask``. When that mask is *verified* (compared
  element by element, once per forward pass, not per layer) to equal a
  bottom-right causal / sliding-window / bidirectional pattern restricted to a
  per-sequence set of valid keys, a description of it is attached to the
  tensor; the attention function then passes the pattern to the kernel as flags
  (so whole key blocks are skipped) and the key padding as a (B, 1, 1, Lk)
  broadcast mask, and never reads the dense tensor. A mask that was changed
  after it was built (a new tensor) carries no description and is read densely.

KV cache: transformers' own caches (DynamicCache & co.) work as with any
backend; ``AttnFastCache`` (``attn_fast.integrations.transformers_cache``)
keeps K/V in ``attn_fast.KVCache`` objects (float32 / float16 / bfloat16
storage, ...) and decodes with their split-KV kernel:
``model.generate(..., cache=AttnFastCache(model.config, dtype="bfloat16"))``.
``AttnFastPagedCache`` is the same with one ``attn_fast.PagedKVCache`` pool
per layer (any storage type, int8 included; beam search forks sequences).

Anything attn_fast cannot compute exactly raises rather than computing
something else: dropout > 0 (training mode), ``output_attentions=True``,
``torch.compile`` tracing, tensors off the CPU. Training: when query, key,
value or ``s_aux`` require grad, the call runs inside an autograd function
whose backward is attn_fast's fused FlashAttention-2 backward
(``scaled_dot_product_attention_backward``) on the same kernel arguments, so
``model.train()`` (dropout 0) + ``loss.backward()`` works; gradients flow to
query, key, value and the sinks (masks and ``position_bias`` get none: a
``position_bias`` that requires grad, T5's learned bias, raises ValueError).

dtypes: float32, float64, float16 and bfloat16 are computed on the model's own
tensors (no copies: inputs are read through their strides and the output is
written straight into the (B, Lq, H, dv) tensor transformers expects, in the
model's dtype). 16-bit calls are accumulated in float32 by the kernels (the
softmax too); additive masks, ``position_bias`` and sinks are passed in
float32. Training a 16-bit model: the forward and the fused backward both run
in the model's dtype (no upcast copy; fp32 accumulation inside the kernels,
each gradient rounded once to the model's dtype; lse and the sinks' gradient
in float32 inside the op).
"""

from __future__ import annotations

import functools
import math

import numpy as np

try:
    import torch
    from transformers import AttentionInterface
    from transformers import masking_utils as _mu
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "attn_fast.integrations.transformers needs torch and transformers: "
        "pip install 'attn_fast[transformers]'"
    ) from e

from .. import _core, _dispatch
from .. import functional as _functional
from .._checks import as_array, fast_view
from ._hf_shared import BACKEND_ATTR, SPEC_ATTR, CallArgs, MaskSpec, cache_layer, mask_spec
from .transformers_cache import AttnFastCache, AttnFastPagedCache, attend_cached

__all__ = ["register", "attention_forward", "attention_mask", "AttnFastCache", "NAME"]
__all__ += ["AttnFastPagedCache"]

NAME = "attn_fast"


def register(name: str = NAME) -> str:
    """Register attn_fast with transformers under `name` (default "attn_fast").

    Adds the attention function to ``transformers.AttentionInterface`` and the
    matching mask builder to ``transformers.masking_utils.AttentionMaskInterface``
    (process-wide; idempotent). Returns `name`, for
    ``model.set_attn_implementation(register())``.
    """
    AttentionInterface.register(name, attention_forward)
    _mu.AttentionMaskInterface.register(name, attention_mask)
    return name


# --------------------------------------------------------------------------- masks


def _pattern(B, Lq, Lk, causal, left, right, key_mask, device):
    """Dense (B, 1, Lq, Lk) bool tensor of a bottom-right causal/window pattern ∧ key_mask."""
    i = torch.arange(Lq, device=device)[:, None] + (Lk - Lq)  # the query's aligned position
    j = torch.arange(Lk, device=device)[None, :]
    vis = torch.ones(Lq, Lk, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= i
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    vis = vis[None, None].expand(B, 1, Lq, Lk)
    if key_mask is not None:
        vis = vis & key_mask[:, None, None, :]
    return vis


def _candidates(mask_function, local_size):
    """Patterns (causal, left, right) the mask is likely to be; each is verified before use."""
    out = []
    if local_size is not None:
        w = int(local_size)
        out += [
            (True, w - 1, -1),
            (False, w, w),
        ]  # sliding_window_overlay / sliding_window_bidirectional_overlay
    if mask_function is _mu.bidirectional_mask_function:
        out.append((False, -1, -1))
    out += [c for c in ((True, -1, -1), (False, -1, -1)) if c not in out]
    return out


def attention_mask(
    batch_size,
    q_length,
    kv_length,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask=None,
    local_size=None,
    allow_is_causal_skip=True,
    allow_is_bidirectional_skip=False,
    use_vmap=False,
    device="cpu",
    **kwargs,
):
    """transformers mask builder for attn_fast (registered by ``register()``).

    Same arguments as ``transformers.masking_utils.sdpa_mask``. Returns None
    (no mask: the attention function uses the module's ``is_causal``) or a
    (batch_size, 1, q_length, kv_length) bool tensor, True = attend, possibly
    carrying a verified flag description (see the module docstring).
    """
    if mask_function is None:
        mask_function = _mu.causal_mask_function
    padding = _mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    tracing = padding is not None and _mu.is_tracing(padding)
    key_mask, pad_all = (
        None,
        True,
    )  # key_mask: (B, Lk) valid keys; padding_mask_function reads padding[b, kv_offset + j]
    if padding is not None and not tracing:
        key_mask = padding[:, kv_offset : kv_offset + kv_length]
        pad_all = key_mask.shape[-1] == kv_length and bool(key_mask.all())
    window_matters = local_size is not None and kv_length >= local_size
    if pad_all and not window_matters and not tracing and isinstance(q_offset, int):
        # Skip the mask only where the sdpa builder would, and where causal alignment cannot matter.
        if allow_is_causal_skip and mask_function is _mu.causal_mask_function:
            if (q_length == kv_length and q_offset == kv_offset) or (
                q_length == 1
                and q_offset >= kv_offset + kv_length - 1  # the one query sees every key
            ):
                return None
        if allow_is_bidirectional_skip and mask_function is _mu.bidirectional_mask_function:
            return None

    dense = _mu.sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        use_vmap=use_vmap,
        device=device,
    )
    shape = (batch_size, 1, q_length, kv_length)
    if dense is None or tracing or dense.device.type != "cpu" or tuple(dense.shape) != shape:
        return dense
    if key_mask is not None and key_mask.shape[-1] != kv_length:
        return dense  # unusual padding-mask size: no description, the dense mask decides
    km = None if pad_all else key_mask.to(device=dense.device, dtype=torch.bool)
    for causal, left, right in _candidates(mask_function, local_size):
        if torch.equal(
            dense, _pattern(batch_size, q_length, kv_length, causal, left, right, km, dense.device)
        ):
            key_np = (
                None if km is None else km.contiguous().numpy().reshape(batch_size, 1, 1, kv_length)
            )
            setattr(dense, SPEC_ATTR, MaskSpec(causal, (left, right), key_np, shape))
            break
    return dense


# --------------------------------------------------------------------------- attention


class _Trainable(torch.autograd.Function):
    """The attention call inside autograd, with attn_fast's fused backward.

    forward(ctx, run, query, key, value, s_aux): run(saved) computes the
    output and fills `saved` with what the backward needs (the kernel's own
    q, k, v, out, lse and keyword arguments). backward maps the gradients
    back to the caller's tensors: dtype, and keys dropped by the causal
    shortcut (zero gradient).
    """

    @staticmethod
    def forward(ctx, run, query, key, value, s_aux):
        saved = {}
        out = run(saved)
        ctx.save_for_backward(
            saved.pop("q"), saved.pop("k"), saved.pop("v"), saved.pop("out"), saved.pop("lse")
        )
        ctx.saved = saved
        ctx.meta = [
            (t.dtype, t.shape) if isinstance(t, torch.Tensor) else None
            for t in (query, key, value, s_aux)
        ]
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        from ..backward import scaled_dot_product_attention_backward

        q, k, v, out, lse = ctx.saved_tensors  # in the forward's dtype (16-bit included), lse fp32
        s = ctx.saved
        do = dout.to(q.dtype).transpose(1, 2)  # (B, Lq, H, dv) -> (B, H, Lq, dv), a view
        grads = scaled_dot_product_attention_backward(do, q, k, v, out, lse, **s["kw"])
        res = [None]
        for g, meta in zip(grads, ctx.meta[:3]):
            dtype, shape = meta
            if g.shape[2] != shape[2]:  # keys the causal shortcut dropped: visible to no query
                g = torch.cat(
                    [g, g.new_zeros(g.shape[:2] + (shape[2] - g.shape[2],) + g.shape[3:])], dim=2
                )
            res.append(g.to(dtype))
        res.append(
            grads[3].to(ctx.meta[3][0]) if len(grads) == 4 and ctx.meta[3] is not None else None
        )
        return tuple(res)


_COMPUTE = (torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = _COMPUTE + _HALF  # what the kernels take as they are
# The NumPy dtype of a kernel dtype's output buffer (bfloat16: its uint16 bits, _new_output).
_NP_OF = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def _refuse(dropout, kwargs, query, key, value):
    """Raise for what attn_fast cannot compute exactly (attention_forward's first test)."""
    if dropout:
        raise NotImplementedError(
            f"attn_fast has no attention dropout (got dropout={dropout}): call model.eval() for "
            "inference, or train with attn_implementation='sdpa'"
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            "attn_fast never forms the attention weights: output_attentions=True needs "
            "attn_implementation='eager'"
        )
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "attn_fast cannot be traced by torch.compile / torch.export; run the model eagerly"
        )
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not t.is_cpu:
            raise TypeError(
                f"{name} is on device {t.device}; the attn_fast backend computes on the CPU only"
            )


def attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    is_causal=None,
    softcap=None,
    s_aux=None,
    position_bias=None,
    **kwargs,
):
    """The transformers attention function backed by attn_fast.

    query (B, H, Lq, d), key (B, H_kv, Lk, d), value (B, H_kv, Lk, dv) CPU
    tensors; attention_mask None, a bool (True = attend) or additive float
    tensor broadcastable to (B, H, Lq, Lk), as built by ``attention_mask`` or
    given by the caller. ``scaling`` defaults to 1/sqrt(d); ``softcap`` caps
    the scaled scores; ``s_aux`` (H,) sink logits; ``position_bias``
    (T5-style) is added to the scores. ``sliding_window`` is ignored, as the
    sdpa backend ignores it: the window is part of the mask.

    Returns (attn_output (B, Lq, H, dv) contiguous tensor in query's dtype, None).
    float16 / bfloat16 tensors are read as they are (no upcast copy) and the
    output is written in their dtype; masks, biases and sinks in float32.
    """
    if (
        dropout
        or kwargs.get("output_attentions")
        or torch.compiler.is_compiling()
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
    ):
        _refuse(dropout, kwargs, query, key, value)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    grad = torch.is_grad_enabled() and (
        query.requires_grad
        or key.requires_grad
        or value.requires_grad
        or (isinstance(s_aux, torch.Tensor) and s_aux.requires_grad)
    )
    layer = cache_layer(key)
    plain = s_aux is None and position_bias is None and not softcap
    if plain and not grad and attention_mask is None:
        # A generated token, checked in O(1) with no record built: against transformers' own
        # cache, or stored and attended in one call by an AttnFastCache layer.
        if layer is None:
            out = _one_token(query, key, value, scaling)
        else:
            out = layer.step(query, key, value, scaling) if is_causal else None
        if out is not None:
            return out, None
    a = CallArgs(attention_mask, scaling, bool(is_causal), softcap, s_aux, position_bias)
    if layer is not None:  # an AttnFastCache layer: store the chunk and attend in the cache
        if grad:
            raise NotImplementedError(
                "AttnFastCache is for inference (no backward through the cache); run under "
                "torch.no_grad(), or train without a cache"
            )
        return attend_cached(layer, query, key, value, a), None
    if grad:
        if isinstance(position_bias, torch.Tensor) and position_bias.requires_grad:
            raise ValueError(
                "a position_bias that requires grad (T5's learned bias) is not supported by the "
                "backward yet; train with attn_implementation='sdpa'"
            )
        run = functools.partial(_attention, query, key, value, a)
        sinks = s_aux if isinstance(s_aux, torch.Tensor) else None
        return _Trainable.apply(run, query, key, value, sinks), None
    return _attention(query, key, value, a), None


setattr(attention_forward, BACKEND_ATTR, True)  # what AttnFastCache checks the model uses

_STRUCTURAL = _dispatch.MaskArgs(causal=True)  # what choose_kernel reads of a decode step's mask


@functools.lru_cache(maxsize=4096)
def _one_token_decodes(Lk):
    """Whether scaled_dot_product_attention runs the decode kernel for one query row
    against Lk keys with structural masks only (_decode_step then gives its bits):
    choose_kernel's answer, asked once per Lk."""
    return _dispatch.choose_kernel(Lq=1, Lk=Lk, mask=_STRUCTURAL) == _dispatch.DECODE


def _decode_shapes_fit(qs, ks, vs):
    """q (B, H, 1, d), k (B, H_kv, Lk, d), v (B, H_kv, Lk, dv), H a multiple of H_kv: what
    _decode_step reads (anything else takes the generic path, whose errors name the shapes)."""
    return (
        len(qs) == len(ks) == len(vs) == 4
        and qs[0] == ks[0] == vs[0]
        and ks[1] == vs[1] > 0
        and qs[1] % ks[1] == 0
        and ks[2] == vs[2]
        and ks[3] == qs[3]
    )


def _one_token(query, key, value, scaling):
    """_decode_step's output for a call without mask, bias, sinks or softcap, or None where
    that call is not a one-row decode of one kernel dtype (the generic path takes it then).
    The module's causal flag does not matter for one query row (it sees every key), and is
    passed as False, as _attention passes it for such a call."""
    dt, qs, ks = query.dtype, query.shape, key.shape  # each a new torch.Size: read once
    if (
        len(qs) != 4
        or qs[2] != 1
        or dt not in _KERNEL_DTYPES
        or key.dtype is not dt
        or value.dtype is not dt
        or not _decode_shapes_fit(qs, ks, value.shape)
        or not _one_token_decodes(ks[2])
    ):
        return None
    return _decode_step(query, key, value, scaling, False)


def _view(t, name):
    """A tensor's memory as NumPy reads it: fast_view's cheap read where it applies, else
    as_array (which raises what is wrong with it, naming it)."""
    f = fast_view(t)
    return f[0] if f is not None else as_array(t, name)


def _new_output(B, H, dv, dtype):
    """(out (B, 1, H, dv) tensor, o: the same memory as a (B, H, 1, dv) NumPy array): for one
    query row both orders are one memory layout, so the kernel writes the output in place."""
    if dtype is torch.bfloat16:  # NumPy has no bfloat16: its bits
        o = np.empty((B, H, 1, dv), dtype=np.uint16)
        return torch.from_numpy(o.reshape(B, 1, H, dv)).view(torch.bfloat16), o
    # np.empty + from_numpy: cheaper than torch.empty + .numpy(); NumPy's reshape (a view):
    # cheaper than the tensor's .view
    o = np.empty((B, H, 1, dv), dtype=_NP_OF[dtype])
    return torch.from_numpy(o.reshape(B, 1, H, dv)), o


def _decode_step(query, key, value, scaling, causal, runs=None, window=(-1, -1)):
    """One generated token: the decode kernel on the tensors' memory.

    What scaled_dot_product_attention would run for this call (Lq = 1 and
    _one_token_decodes(Lk) says the decode kernel is chosen there too: the same bits),
    without its generic argument handling, which cost more than the kernel at
    a few hundred cached keys (bench/notes_archive.md, dec6). query (B, H, 1, d), key
    (B, H_kv, Lk, d), value (B, H_kv, Lk, dv) CPU tensors of one kernel dtype
    (the caller made sure); the binding checks shapes, strides, dtypes and
    the scale. runs: None (every key valid) or (kv_start, kv_lens) int64 (B,),
    sequence b's valid keys [kv_start[b], kv_start[b] + kv_lens[b]) (left or
    right padding, MaskSpec.key_runs): read by the decode kernel as the start
    and length of a ring that does not wrap, where the generic path would take
    the tiled kernel with an element mask (never with a window: _attention
    takes runs only for masks without one). window: (left, right) of a
    sliding-window layer, as scaled_dot_product_attention's window_size.
    Returns (B, 1, H, dv), contiguous, in that dtype.
    """
    B, Hq, _, d = query.shape
    scale = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    views = _core.tensor_views(query, key, value)  # one C call: the common kinds
    if views is None:
        views = _view(query, "query"), _view(key, "key"), _view(value, "value")
    q, k, v = views
    out, o = _new_output(B, Hq, v.shape[-1], query.dtype)
    # causal: one query row, bottom-right aligned: every (valid) key is visible all the same
    kv_start, kv_lens = (None, None) if runs is None else runs
    _dispatch.decode_step(q, k, v, o, None, scale, bool(causal), window, None, kv_lens, kv_start)
    return out


def _kernel_dtype(query, key, value):
    """(query, key, value, dt, cdt): the three in one kernel dtype dt (the query's, or
    float32 for anything else: int, mixed), and cdt, the dtype of masks, biases and sinks."""
    dt = query.dtype if query.dtype in _KERNEL_DTYPES else torch.float32
    if query.dtype != dt or key.dtype != dt or value.dtype != dt:
        if not (
            query.is_floating_point() and key.is_floating_point() and value.is_floating_point()
        ):
            raise TypeError(
                "query/key/value must be floating point, got "
                f"{query.dtype}, {key.dtype}, {value.dtype}"
            )
        query, key, value = query.to(dt), key.to(dt), value.to(dt)
    return query, key, value, dt, torch.float32 if dt in _HALF else dt


class _Visibility:
    """Which keys each query sees, as the kernel takes it: causal flag, window (left,
    right), mask (None, a (B, 1, 1, Lk) NumPy key mask, or a 4-D bool / additive tensor),
    runs (a one-row call's key mask as runs of valid keys, see _decode_step; None or False
    when there are none) and keep (keys beyond it are visible to no query; None = all)."""

    __slots__ = ("causal", "window", "mask", "runs", "keep")

    def __init__(self, mask, B, Lq, Lk, is_causal, cdt):
        self.causal, self.window, self.mask, self.runs, self.keep = False, None, mask, None, None
        spec = mask_spec(mask)
        if spec is not None and spec.shape == (B, 1, Lq, Lk):
            self.causal = spec.causal
            if spec.window != (-1, -1):
                self.window = spec.window
            self.mask = spec.key_mask  # (B, 1, 1, Lk) NumPy bool or None
            if self.mask is not None and Lq == 1 and self.window is None and _one_token_decodes(Lk):
                self.runs = spec.key_runs()  # False unless each row's valid keys are one run
        elif mask is not None:
            self.mask = _caller_mask(mask, Lk, cdt)
        elif is_causal and Lq > 1:
            # No mask and a causal module: torch's top-left causal mask, as the sdpa backend has it.
            if Lk >= Lq:  # Lq == Lk after the cut, where bottom-right == top-left
                self.keep, self.causal = Lq, True
            else:
                self.mask = torch.ones(Lq, Lk, dtype=torch.bool).tril()


def _caller_mask(mask, Lk, cdt):
    """A mask the caller built (no MaskSpec): checked, cut to Lk keys, additive ones in cdt."""
    if mask.ndim != 4:
        raise ValueError(
            f"attention_mask must be 4-D (B, 1 or H, Lq, Lk), got shape {tuple(mask.shape)}"
        )
    if mask.shape[-1] > Lk:  # as the eager backend does (static caches)
        mask = mask[..., :Lk]
    if mask.dtype != torch.bool:
        if not mask.is_floating_point():
            raise TypeError(
                "attention_mask must be bool (True = attend) or an additive float tensor, "
                f"got {mask.dtype}"
            )
        mask = mask.to(cdt)
    return mask


def _attention(query, key, value, a, saved=None):
    """The kernel call for a: CallArgs; with `saved` (a dict) also keeps what the backward
    needs (_Trainable)."""
    out_dtype = query.dtype
    query, key, value, dt, cdt = _kernel_dtype(query, key, value)
    B, Hq, Lq, _ = query.shape
    vis = _Visibility(a.mask, B, Lq, key.shape[2], a.causal, cdt)
    position_bias = a.position_bias
    if vis.keep is not None:  # keys >= keep are visible to no query
        key, value = key[:, :, : vis.keep], value[:, :, : vis.keep]
        if position_bias is not None:
            position_bias = position_bias[..., : vis.keep]
    if (
        saved is None
        and Lq == 1
        and (vis.mask is None or vis.runs)  # runs: the spec's key mask as one run per row
        and position_bias is None
        and a.s_aux is None
        and not a.softcap
        and _one_token_decodes(key.shape[2])
        and _decode_shapes_fit(query.shape, key.shape, value.shape)
    ):
        window = (-1, -1) if vis.window is None else vis.window
        out = _decode_step(query, key, value, a.scaling, vis.causal, vis.runs or None, window)
    else:
        out = _generic(query, key, value, vis, position_bias, a, cdt, saved)
    return out if dt == out_dtype else out.to(out_dtype)


def _bias_mask(mask, position_bias, causal, Lq, Lk, cdt):
    """(mask, causal): position_bias folded into the mask (and the causal flag into it)."""
    pb = position_bias.to(cdt)
    if causal:  # fold the causal flag into the bias (Lq == Lk here or the spec said so)
        pb = torch.where(_pattern(1, Lq, Lk, True, -1, -1, None, pb.device), pb, -math.inf)
    if mask is None:
        return pb, False
    if isinstance(mask, np.ndarray) or mask.dtype == torch.bool:
        return torch.where(torch.as_tensor(mask), pb, -math.inf), False
    return pb + mask, False


def _generic(query, key, value, vis, position_bias, a, cdt, saved):
    """attn_fast.scaled_dot_product_attention for any call _attention does not decode itself;
    returns (B, Lq, H, dv) in the kernel dtype."""
    B, Hq, Lq, _ = query.shape
    Lk = key.shape[2]
    mask, causal = vis.mask, vis.causal
    if position_bias is not None:
        mask, causal = _bias_mask(mask, position_bias, causal, Lq, Lk, cdt)
    kw = {}
    if vis.window is not None:
        kw["window_size"] = vis.window
    if a.s_aux is not None:
        s_aux = a.s_aux
        kw["sinks"] = as_array(s_aux.to(cdt) if isinstance(s_aux, torch.Tensor) else s_aux, "s_aux")
    if a.softcap:
        kw["softcap"] = float(a.softcap)
    if mask is not None:
        kw["attn_mask"] = as_array(mask, "attention_mask")
    out = torch.empty((B, Lq, Hq, value.shape[-1]), dtype=query.dtype)
    gqa = key.shape[1] != Hq
    res = _functional.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=causal,
        scale=a.scaling,
        enable_gqa=gqa,
        out=out.transpose(1, 2),
        return_lse=saved is not None,
        **kw,
    )
    if saved is not None:
        saved.update(
            q=query.detach(),
            k=key.detach(),
            v=value.detach(),
            out=out.transpose(1, 2).detach(),
            lse=res[1],  # a tensor: torch in, torch out
            kw=dict(kw, is_causal=causal, scale=a.scaling, enable_gqa=gqa),
        )
    return out
