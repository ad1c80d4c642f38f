"""One Transformer layer, and a tiny decoder-only language model built from them.

The chapter's picture of one layer (pre-norm, as GPT-2 onwards and Llama):

    x ─┬─ norm ─ attention (talk) ─┐
       └────────── + <─────────────┘      residual ("deposit")
    h ─┬─ norm ─ cross-attention ──┐      (decoder of an encoder-decoder only)
       └────────── + <─────────────┘
    h ─┬─ norm ─ feed-forward (work) ─┐
       └────────── + <────────────────┘   -> next layer

Norms: ``LayerNorm`` (subtract the mean, divide by the std, scale and shift)
or ``RMSNorm`` (divide by the root mean square, scale). Feed-forward: ``MLP``
(W2 · GELU(W1 x + b1) + b2, GELU in its tanh form as GPT-2) or ``SwiGLU``
(W_down · (SiLU(W_gate x) ⊙ W_up x), Llama). All weights are NumPy arrays
with torch's Linear convention y = x Wᵀ (+ b).

``TinyTransformerLM``: token embedding, N blocks, final norm, output
projection; ``forward`` returns logits and ``generate`` decodes with a KV
cache (prefill once, then one token per step) or without one.

Shape legend: B batch, L tokens, D model dim, F feed-forward dim, V vocabulary.

16-bit models (``dtype=np.float16`` or ``"bfloat16"``; ``_lowp`` says how):
weights and activations in that dtype, every product and element-wise step
computed in float32 from the 16-bit operands and rounded once, attention in
the 16-bit kernel, the KV cache (``make_cache``) in the model's dtype.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._checks import _is_torch_tensor, check_int, check_real, shape_str, to_input_kind
from ._lowp import add, as_layer_input, f32, is_half, layer_dtype, linear
from ._module import Module, as_rng
from .multihead import MultiHeadAttention
from .positional import RoPE, sinusoidal

if TYPE_CHECKING:
    from .kv_cache import KVCache, LayerCaches

__all__ = ["LayerNorm", "RMSNorm", "MLP", "SwiGLU", "TransformerBlock", "TinyTransformerLM"]


def _init(gen: np.random.Generator, shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """Normal with std 1/sqrt(fan_in)."""
    return (gen.standard_normal(shape) / math.sqrt(shape[-1])).astype(dtype)


class _Layer(Module):
    """A layer applied to x (…, D) with weights of one dtype (``_dtype``).

    NumPy in, NumPy out: the plain float case computes on x as given. A torch tensor, or
    any input of a 16-bit layer, is read by ``as_layer_input`` (TypeError naming both
    dtypes, with a cast hint) and the result comes back in the input's kind (torch in,
    torch out). ``_forward`` computes on a NumPy array; 16-bit: every product and
    element-wise step in float32, each result rounded once."""

    @property
    def _dtype(self) -> np.dtype:
        raise NotImplementedError

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if not _is_torch_tensor(x) and not is_half(self._dtype):
            return self._forward(x)
        what = f"the {type(self).__name__}'s weights"
        return to_input_kind(self._forward(as_layer_input(x, "x", self._dtype, what)), x)

    def _forward(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def _compute(dt: np.dtype) -> tuple[Any, Any]:
    """(cast, eps type) of the arithmetic of a layer with weights of dtype `dt`: float32
    for 16-bit weights, the array as it is otherwise."""
    if is_half(dt):
        return f32, np.float32
    return (lambda a: a), float


class _Norm(_Layer):
    """A norm over the last axis (D,) with a weight (D,): ``_normalize`` on x in the
    compute dtype; 16-bit: computed in float32, rounded once."""

    def __init__(self, dim: int, eps: float, dtype: DTypeLike) -> None:
        self.eps = check_real(eps, "eps", minimum=0.0)
        self.weight = np.ones(check_int(dim, "dim", 1), dtype=layer_dtype(dtype))

    @property
    def _dtype(self) -> np.dtype:
        return self.weight.dtype

    def _forward(self, x: np.ndarray) -> np.ndarray:
        c, eps = _compute(self._dtype)
        y = self._normalize(c(x), eps(self.eps), c)
        return y.astype(self._dtype) if is_half(self._dtype) else y

    def _normalize(self, x: np.ndarray, eps: Any, c: Any) -> np.ndarray:
        raise NotImplementedError


class LayerNorm(_Norm):
    """y = (x - mean) / sqrt(var + eps) · weight + bias, over the last axis (D,).

    x (…, D) of the weights' dtype; 16-bit: computed in float32, rounded once (NumPy,
    ml_dtypes or torch input; torch in, torch out; another dtype: TypeError with a cast hint)."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: DTypeLike = np.float32) -> None:
        super().__init__(dim, eps, dtype)
        self.bias = np.zeros(self.weight.shape, dtype=self.weight.dtype)

    def _own(self):
        return {"weight": self.weight, "bias": self.bias}

    def _normalize(self, x, eps, c):
        xc = x - x.mean(axis=-1, keepdims=True)
        var = np.mean(xc * xc, axis=-1, keepdims=True)
        return xc / np.sqrt(var + eps) * c(self.weight) + c(self.bias)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x²) + eps) · weight, over the last axis (D,).

    x (…, D) of the weights' dtype; 16-bit: computed in float32, rounded once (NumPy,
    ml_dtypes or torch input; torch in, torch out; another dtype: TypeError with a cast hint)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: DTypeLike = np.float32) -> None:
        super().__init__(dim, eps, dtype)

    def _own(self):
        return {"weight": self.weight}

    def _normalize(self, x, eps, c):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + eps) * c(self.weight)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh form: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    return (
        0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi).astype(x.dtype) * (x + 0.044715 * x * x * x)))
    )


def silu(x: np.ndarray) -> np.ndarray:
    """SiLU (swish): x · sigmoid(x), with sigmoid(x) = (1 + tanh(x/2)) / 2 (no overflow)."""
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


class _FeedForward(_Layer):
    """A feed-forward D -> F -> D whose weights ``_make`` draws (normal, std
    1/sqrt(fan_in)) from `rng` (seed or Generator) in `dtype`."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        rng: int | np.random.Generator | None = None,
        dtype: DTypeLike = np.float32,
    ) -> None:
        gen = as_rng(rng)
        dtype = layer_dtype(dtype)
        self._make(gen, d_model, d_ff, dtype)

    def _make(self, gen: np.random.Generator, d_model: int, d_ff: int, dtype: np.dtype) -> None:
        raise NotImplementedError


class MLP(_FeedForward):
    """GPT-2's feed-forward: W2 · GELU(W1 x + b1) + b2. W1 (F, D), W2 (D, F).

    x (…, D) of the weights' dtype; 16-bit: each product and the GELU in
    float32, each result rounded once."""

    def _make(self, gen, d_model, d_ff, dtype):
        self.W1 = _init(gen, (d_ff, d_model), dtype)
        self.b1 = np.zeros(d_ff, dtype=dtype)
        self.W2 = _init(gen, (d_model, d_ff), dtype)
        self.b2 = np.zeros(d_model, dtype=dtype)

    @property
    def _dtype(self) -> np.dtype:
        return self.W1.dtype

    def _own(self):
        return {"W1": self.W1, "b1": self.b1, "W2": self.W2, "b2": self.b2}

    def _forward(self, x: np.ndarray) -> np.ndarray:
        h = linear(x, self.W1, self.b1)  # 16-bit: rounded once, as is the GELU below
        g = gelu(f32(h)).astype(h.dtype) if is_half(h.dtype) else gelu(h)
        return linear(g, self.W2, self.b2)


class SwiGLU(_FeedForward):
    """Llama's feed-forward: W_down · (SiLU(W_gate x) ⊙ W_up x).

    W_gate, W_up (F, D) are two views of one (2F, D) array (one product);
    W_down (D, F). x (…, D) of the weights' dtype; 16-bit: each product and
    the gating in float32, each result rounded once."""

    def _make(self, gen, d_model, d_ff, dtype):
        self._w_gate_up = _init(gen, (2 * d_ff, d_model), dtype)
        self.W_gate, self.W_up = self._w_gate_up[:d_ff], self._w_gate_up[d_ff:]
        self.W_down = _init(gen, (d_model, d_ff), dtype)
        self.d_ff = d_ff

    @property
    def _dtype(self) -> np.dtype:
        return self.W_down.dtype

    def _own(self):
        return {"W_gate": self.W_gate, "W_up": self.W_up, "W_down": self.W_down}

    def _forward(self, x: np.ndarray) -> np.ndarray:
        c = _compute(self._dtype)[0]
        gu = c(linear(x, self._w_gate_up))  # (…, 2F), one product; 16-bit: rounded once
        g, u = gu[..., : self.d_ff], gu[..., self.d_ff :]
        a = silu(g) * u
        return linear(a.astype(self._dtype) if is_half(self._dtype) else a, self.W_down)


_NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}
_FFNS = {"gelu": MLP, "swiglu": SwiGLU}


class TransformerBlock(Module):
    """Pre-norm Transformer layer: x + attn(norm1 x), [+ cross(norm_cross h)], + ffn(norm2 h).

    Parameters
    ----------
    d_model, num_heads, num_kv_heads, head_dim, bias, positional :
        as ``MultiHeadAttention`` (positional = None, "rope" or a RoPE object).
    d_ff : feed-forward width F (default 4·D for "gelu", 8/3·D rounded up to
        a multiple of 8 for "swiglu").
    norm : "layernorm" or "rmsnorm"; eps : its epsilon (default 1e-5 / 1e-6).
    ffn : "gelu" (MLP with biases) or "swiglu".
    cross_attention : add a cross-attention sub-layer (decoder of an
        encoder-decoder); kv_dim is the context's feature size (default D).
    rng, dtype : initial weights (seed or Generator) and their dtype: float32,
        float64, float16 or bfloat16 (16-bit: module docstring); x must have it.

    Parameter names (``state_dict`` / ``load_weights``)::

        norm1.weight [norm1.bias]    attn.Wq attn.Wk attn.Wv attn.Wo [attn.bq …]
        norm_cross.* cross.Wq …      (cross_attention=True only)
        norm2.weight [norm2.bias]    ffn.W1 ffn.b1 ffn.W2 ffn.b2 | ffn.W_gate ffn.W_up ffn.W_down
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        d_ff: int | None = None,
        *,
        head_dim: int | None = None,
        norm: str = "layernorm",
        eps: float | None = None,
        ffn: str = "gelu",
        bias: bool = False,
        positional: str | RoPE | None = None,
        cross_attention: bool = False,
        kv_dim: int | None = None,
        rng: int | np.random.Generator | None = None,
        dtype: DTypeLike = np.float32,
    ) -> None:
        if norm not in _NORMS:
            raise ValueError(f"norm must be one of {sorted(_NORMS)}, got {norm!r}")
        if ffn not in _FFNS:
            raise ValueError(f"ffn must be one of {sorted(_FFNS)}, got {ffn!r}")
        gen = as_rng(rng)
        D = check_int(d_model, "d_model", 1)
        dtype = layer_dtype(dtype)
        if d_ff is None:
            d_ff = 4 * D if ffn == "gelu" else -(-(8 * D // 3) // 8) * 8
        self.d_model, self.d_ff, self.dtype = D, check_int(d_ff, "d_ff", 1), dtype
        neps = {} if eps is None else {"eps": eps}
        self.norm1 = _NORMS[norm](D, dtype=dtype, **neps)
        self.attn = MultiHeadAttention(
            D, num_heads, num_kv_heads, head_dim, bias, positional, rng=gen, dtype=dtype
        )
        self.cross = None
        if cross_attention:
            self.norm_cross = _NORMS[norm](D, dtype=dtype, **neps)
            self.cross = MultiHeadAttention(
                D,
                num_heads,
                num_kv_heads,
                head_dim,
                bias,
                None,
                kv_dim=kv_dim,
                rng=gen,
                dtype=dtype,
            )
        self.norm2 = _NORMS[norm](D, dtype=dtype, **neps)
        self.ffn = _FFNS[ffn](D, self.d_ff, rng=gen, dtype=dtype)

    def _children(self):
        ch = {"norm1": self.norm1, "attn": self.attn}
        if self.cross is not None:
            ch.update(norm_cross=self.norm_cross, cross=self.cross)
        ch.update(norm2=self.norm2, ffn=self.ffn)
        return ch

    def __call__(
        self,
        x: ArrayLike,
        context: ArrayLike | None = None,
        mask: Any = None,
        cache: KVCache | None = None,
        *,
        causal: bool = True,
        cross_cache: KVCache | None = None,
    ) -> Any:
        """x (L, D) or (B, L, D) -> same shape.

        causal / mask / cache go to the self-attention (causal defaults to
        True: a decoder layer; pass causal=False for an encoder layer).
        context (Lk, D_kv) or (B, Lk, D_kv) feeds the cross-attention and is
        required exactly when the block has one; cross_cache optionally
        keeps its projected K/V across decode steps.
        """
        if (context is None) != (self.cross is None):
            raise ValueError(
                "context= is required by a block with cross_attention=True and not accepted "
                "otherwise"
            )
        like = x
        x = self.attn._check_input(x, "x", self.d_model)
        h = add(x, self.attn(self.norm1(x), mask=mask, cache=cache, causal=causal))
        if self.cross is not None:
            h = add(h, self.cross(self.norm_cross(h), context=context, cache=cross_cache))
        return to_input_kind(add(h, self.ffn(self.norm2(h))), like)


class TinyTransformerLM(Module):
    """A decoder-only language model: embed, N pre-norm blocks, norm, project.

    Parameters
    ----------
    vocab_size, d_model, num_layers, num_heads : V, D, N, H.
    num_kv_heads : H_kv (GQA when < H). d_ff, head_dim : as TransformerBlock.
    norm, ffn : "rmsnorm"/"layernorm", "swiglu"/"gelu" (default Llama-like).
    positional : "rope" (default; ``rope_base``, ``rotary_dim``,
        ``rope_interleaved`` configure it) or "sinusoidal" (added to the embeddings).

    tie_embeddings : use the embedding matrix as the output projection.
    seed : initial random weights (normal, std 1/sqrt(fan_in); embedding std 1).
    dtype : float32 (default), float64, float16 or bfloat16 (weights,
        activations, logits and ``make_cache``'s KV cache; 16-bit: module
        docstring).

    Notes
    -----
    Weight names (``state_dict``, ``load_weights``; e.g. ``np.load("m.npz")``)::

        embed.weight                 (V, D)
        blocks.{i}.norm1.weight      (D,)  [+ .bias for layernorm]
        blocks.{i}.attn.Wq           (H·d_h, D)  attn.Wk, attn.Wv (H_kv·d_h, D)  attn.Wo (D, H·d_h)
        blocks.{i}.norm2.weight      (D,)
        blocks.{i}.ffn.W_gate, ffn.W_up (F, D), ffn.W_down (D, F)
                                     | gelu: ffn.W1 (F, D) b1 W2 (D, F) b2
        norm.weight                  (D,)  [+ norm.bias]
        lm_head.weight               (V, D)  (absent when tie_embeddings)
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        d_ff: int | None = None,
        *,
        head_dim: int | None = None,
        norm: str = "rmsnorm",
        ffn: str = "swiglu",
        positional: str = "rope",
        rope_base: float = 10000.0,
        rotary_dim: int | None = None,
        rope_interleaved: bool = False,
        tie_embeddings: bool = False,
        seed: int | None = 0,
        dtype: DTypeLike = np.float32,
    ) -> None:
        V, D = check_int(vocab_size, "vocab_size", 1), check_int(d_model, "d_model", 1)
        N, H = check_int(num_layers, "num_layers", 1), check_int(num_heads, "num_heads", 1)
        if positional not in ("rope", "sinusoidal"):
            raise ValueError(f"positional must be 'rope' or 'sinusoidal', got {positional!r}")
        gen = np.random.default_rng(seed)
        self.vocab_size, self.d_model, self.num_layers = V, D, N
        self.dtype = dtype = layer_dtype(dtype)
        self.positional = positional
        self.embed = gen.standard_normal((V, D)).astype(dtype)
        rope = None
        if positional == "rope":
            dh = check_int(head_dim, "head_dim", 1) if head_dim is not None else D // H
            rope = RoPE(
                dh, base=rope_base, rotary_dim=rotary_dim, interleaved=rope_interleaved
            )  # shared tables
        self.blocks = [
            TransformerBlock(
                D,
                H,
                num_kv_heads,
                d_ff,
                head_dim=head_dim,
                norm=norm,
                ffn=ffn,
                positional=rope,
                rng=gen,
                dtype=dtype,
            )
            for _ in range(N)
        ]
        self.norm = _NORMS[norm](D, dtype=dtype)
        self.tie_embeddings = bool(tie_embeddings)
        self.lm_head = self.embed if self.tie_embeddings else _init(gen, (V, D), dtype)
        a = self.blocks[0].attn
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim

    class _Embed(Module):
        def __init__(self, w):
            self.weight = w

        def _own(self):
            return {"weight": self.weight}

    def _children(self):
        ch = {"embed": self._Embed(self.embed)}
        ch.update({f"blocks.{i}": b for i, b in enumerate(self.blocks)})
        ch["norm"] = self.norm
        if not self.tie_embeddings:
            ch["lm_head"] = self._Embed(self.lm_head)
        return ch

    def _check_tokens(self, tokens: ArrayLike, name: str = "tokens") -> np.ndarray:
        t = np.asarray(tokens)
        if t.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an integer array, got dtype {t.dtype}")
        if t.ndim not in (1, 2):
            raise ValueError(f"{name} must be (L,) or (B, L), got shape {shape_str(t)}")
        if t.size and (t.min() < 0 or t.max() >= self.vocab_size):
            raise ValueError(
                f"{name} must lie in [0, vocab_size={self.vocab_size}), got range [{t.min()}, "
                f"{t.max()}]"
            )
        return t

    def make_cache(self, batch: int, capacity: int, **kw: Any) -> LayerCaches:
        """A ``LayerCaches`` sized for this model (one KVCache per block)."""
        from .kv_cache import LayerCaches

        return LayerCaches(
            self.num_layers,
            batch,
            self.num_kv_heads,
            self.head_dim,
            capacity=capacity,
            dtype=self.dtype,
            **kw,
        )

    def _check_cache(self, cache: LayerCaches, B: int, L: int) -> None:
        """Every layer's cache fits (checked before layer 0 appends anything, so
        a bad cache leaves every layer unchanged)."""
        if len(cache) != self.num_layers:
            raise ValueError(f"cache has {len(cache)} layers but the model has {self.num_layers}")
        for i, blk in enumerate(self.blocks):
            try:
                blk.attn._check_cache(cache[i], B)
            except (TypeError, ValueError) as e:
                raise type(e)(f"cache[{i}]: {e}") from None
        pos = [c.positions for c in cache]
        if any(not np.array_equal(p, pos[0]) for p in pos):
            raise ValueError(
                f"the layers' caches are at different positions {[p.tolist() for p in pos]}"
            )
        for i, c in enumerate(cache):
            if c.growable:
                continue
            if c.window is None and int(c.lengths.max()) + L > c.capacity:
                raise ValueError(
                    f"cache[{i}] holds {c.lengths.tolist()} tokens of a fixed capacity "
                    f"{c.capacity}: "
                    f"no room for {L} more (growable=False)"
                )
            if c.window is not None and L > c.capacity - c.window + 1:
                raise ValueError(
                    f"cache[{i}]: a chunk of {L} tokens does not fit its fixed ring of "
                    f"{c.capacity} slots "
                    f"with window {c.window} (growable=False)"
                )

    def forward(self, tokens: ArrayLike, cache: LayerCaches | None = None) -> np.ndarray:
        """Logits for every position: tokens (L,) or (B, L) ints -> (L, V) or (B, L, V).

        cache : optional ``LayerCaches`` (``make_cache``); the tokens continue
        the cached sequence (positions start at ``cache[0].positions``) and
        their keys/values are appended. Attention is causal.
        """
        t = self._check_tokens(tokens)
        squeeze = t.ndim == 1
        t2 = t[None] if squeeze else t
        B, L = t2.shape
        if cache is not None:
            self._check_cache(cache, B, L)
        x = self.embed[t2]  # (B, L, D), a gather (copy)
        if self.positional == "sinusoidal":
            off = 0 if cache is None else np.asarray(cache[0].positions)
            if is_half(self.dtype):  # added in float32, rounded once
                pe = sinusoidal(L, self.d_model, offset=off, dtype=np.float32)
                x = (f32(x) + pe).astype(self.dtype)
            else:
                x += sinusoidal(L, self.d_model, offset=off, dtype=self.dtype)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache=None if cache is None else cache[i], causal=True)
        logits = linear(self.norm(x), self.lm_head)
        return logits[0] if squeeze else logits

    __call__ = forward

    def generate(
        self,
        prompt_tokens: ArrayLike,
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        use_cache: bool = True,
    ) -> np.ndarray:
        """Continue the prompt by max_new_tokens tokens.

        prompt_tokens : (Lp,) or (B, Lp) ints, Lp >= 1.

        temperature : 0 -> greedy (argmax); > 0 -> sample from softmax(logits / T)
            with ``np.random.default_rng(seed)``.

        use_cache : True: prefill the prompt once into a KV cache, then run one
            token per step. False: re-run ``forward`` on the whole growing
            sequence each step (the slow baseline; same tokens).

        Returns the prompt followed by the new tokens, (Lp + N,) or (B, Lp + N), int64.
        """
        t = self._check_tokens(prompt_tokens, "prompt_tokens")
        squeeze = t.ndim == 1
        seq = (t[None] if squeeze else t).astype(np.int64)
        B, Lp = seq.shape
        if Lp < 1:
            raise ValueError("prompt_tokens must hold at least one token")
        n = check_int(max_new_tokens, "max_new_tokens", 0)
        temperature = check_real(temperature, "temperature", minimum=0.0)
        gen = np.random.default_rng(seed)
        out = np.empty((B, Lp + n), dtype=np.int64)
        out[:, :Lp] = seq
        if n:
            cache = self.make_cache(B, Lp + n) if use_cache else None
            logits = self.forward(seq, cache=cache)[:, -1]  # prefill
            for step in range(n):
                nxt = self._pick(logits, temperature, gen)
                out[:, Lp + step] = nxt
                if step == n - 1:
                    break
                if use_cache:
                    logits = self.forward(nxt[:, None], cache=cache)[:, -1]
                else:
                    logits = self.forward(out[:, : Lp + step + 1])[:, -1]
        return out[0] if squeeze else out

    @staticmethod
    def _pick(logits: np.ndarray, temperature: float, gen: np.random.Generator) -> np.ndarray:
        """(B, V) logits -> (B,) next tokens."""
        if temperature == 0:
            return np.argmax(logits, axis=-1)
        z = logits.astype(np.float64) / temperature
        z -= z.max(axis=-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        u = gen.random((p.shape[0], 1))
        return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)
