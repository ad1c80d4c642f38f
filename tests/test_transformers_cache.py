"""AttnFastCache: a transformers Cache backed by attn_fast.KVCache, end to end.

Small decoders from random configs (no download) generate once with
transformers' own DynamicCache + "sdpa" (the reference) and once with
AttnFastCache + "attn_fast". Tolerances, max |Δ logits| over the compared
generation steps (the logits of these random-weight models have max |logit|
~0.6, std ~0.17, and the top-2 gap can be as small as ~5e-3):

- float32 storage, float32 model: identical tokens, |Δ| <= 1e-5 (observed ~2e-7);
- float16 storage, float32 model: |Δ| <= 1e-3 (observed ~1e-4);
- bfloat16 storage, float32 model: |Δ| <= 5e-3 (observed ~7e-4);
- bfloat16 model (and storage) vs sdpa + DynamicCache in bfloat16:
  |Δ| <= 2e-2 (the model's own bf16 rounding dominates; observed ~4e-3).

Reduced-precision runs may pick a different token once two logits are
closer than the rounding; the logits are then compared up to and including
the first differing step (the steps whose inputs are still the same tokens).

Every test checks that the attention went through the cache (KVCache.attend
once per layer per forward pass, the decode kernel for the one-token steps)
and that attn_fast's dense-K/V entry point was never called.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch", reason="torch not installed (pip install 'attn_fast[transformers]')"
)
transformers = pytest.importorskip(
    "transformers", reason="transformers not installed (pip install 'attn_fast[transformers]')"
)

import attn_fast.functional as F  # noqa: E402
import attn_fast.integrations.transformers as af_hf  # noqa: E402
import attn_fast.integrations.transformers_cache as af_cache  # noqa: E402
import attn_fast.kv_cache as kvc  # noqa: E402
from attn_fast import KVCache, _dispatch  # noqa: E402
from attn_fast._dispatch import DECODE_MAX_LQ  # noqa: E402

TOL = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 5e-3}
TOL_BF16_MODEL = 2e-2


def _int8_available():
    try:
        KVCache(1, 1, 1, capacity=1, dtype="int8")
    except (TypeError, ValueError):
        return False
    return True


STORAGE = [
    "float32",
    "float16",
    "bfloat16",
    pytest.param(
        "int8",
        marks=pytest.mark.skipif(not _int8_available(), reason="KVCache has no int8 storage yet"),
    ),
    "float8_e4m3",  # fp8 codes with per-token scales: the same cache, no other change
    "float8_e5m2",
]


@pytest.fixture(autouse=True)
def _registered():
    af_hf.register()
    torch.manual_seed(0)


def install_call_counters(monkeypatch, cache_cls, seen, on_attend, kernels):
    """Wrap ``cache_cls.attend`` (``on_attend(*args)`` is told of each call), the kernels of
    ``attn_fast._core`` named in ``kernels`` (``{name: key}``: seen[key] += 1 per call) and
    attn_fast's dense sdpa (seen["dense"] += 1); every kernel call goes through the proxy."""
    real_attend, real_core = cache_cls.attend, _dispatch._core

    def attend(self, *a, **kw):
        on_attend(*a)
        return real_attend(self, *a, **kw)

    real_step = getattr(cache_cls, "_step", None)  # KVCache: append + attend in one call

    def step(self, q, *a, **kw):
        o = real_step(self, q, *a, **kw)
        if o is not None:  # None: append and attend follow
            on_attend(q)
        return o

    class Core:
        def __getattr__(self, name):
            fn = getattr(real_core, name)
            if name == "DecodeRing" and "decode" in kernels:  # each call of a bound ring
                return lambda *a: counted_ring(fn(*a))  # is one decode kernel call
            if name == "cache_step" and "decode" in kernels:  # so is each step on one

                def counted_step(ring, *a):
                    o = fn(ring.ring, *a)
                    seen[kernels["decode"]] += o is not None
                    return o

                return counted_step
            if name not in kernels:
                return fn

            def counted_call(*a, **kw):
                seen[kernels[name]] += 1
                return fn(*a, **kw)

            return counted_call

    def counted_ring(ring):
        def call(*a):
            seen[kernels["decode"]] += 1
            return ring(*a)

        call.ring = ring  # what cache_step takes
        return call

    real_sdpa = F.scaled_dot_product_attention

    def dense(*a, **kw):
        seen["dense"] += 1
        return real_sdpa(*a, **kw)

    monkeypatch.setattr(cache_cls, "attend", attend)
    if real_step is not None:
        monkeypatch.setattr(cache_cls, "_step", step)
    monkeypatch.setattr(_dispatch, "_core", Core())
    monkeypatch.setattr(F, "scaled_dot_product_attention", dense)
    return seen


@pytest.fixture
def counted(monkeypatch):
    """Counts KVCache.attend calls, decode/tiled kernel calls, and dense attn_fast calls."""
    seen = {"attend": [], "decode": 0, "forward": 0, "dense": 0}
    return install_call_counters(
        monkeypatch,
        kvc.KVCache,
        seen,
        lambda q, *rest: seen["attend"].append(tuple(q.shape)),
        {"decode": "decode", "forward": "forward"},
    )


def _common(**kw):
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    base.update(kw)
    return base


def make(kind, dtype=torch.float32, **kw):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_common(**kw)))
    elif kind == "llama_d80":  # head dim 80, 6 query heads over 2 kv heads
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                **_common(hidden_size=96, num_attention_heads=6, head_dim=80, **kw)
            )
        )
    elif kind == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_common(**kw)))
    elif kind == "mistral_window":  # every layer a sliding-window layer of 8 tokens
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=8, **_common(**kw))
        )
    else:
        raise ValueError(kind)
    return model.to(dtype).eval()


def left_padded(B, L, pads, rng=None, vocab=128):
    """Token ids (B, L) and a 2-D mask with pads[b] padding tokens on the left of row b;
    ids drawn from the seeded ``rng`` fixture when given."""
    g = torch.Generator().manual_seed(1 if rng is None else int(rng.integers(2**31)))
    ids = torch.randint(1, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        am[b, :p] = 0
        ids[b, :p] = 0
    return ids, am


def generate(model, impl, ids, am, new, cache=None, seed=None, **kw):
    """generate(): (sequences, per-step logits (B, new, vocab) float32)."""
    model.set_attn_implementation(impl)
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if cache is None else {"cache": cache}
    with torch.no_grad():
        g = model.generate(
            input_ids=ids,
            attention_mask=am,
            max_new_tokens=new,
            min_new_tokens=new,
            output_logits=True,
            return_dict_in_generate=True,
            **extra,
            **kw,
        )
    return g.sequences, torch.stack(g.logits, dim=1).float()


def compared_diff(ref_ids, ref_logits, got_ids, got_logits, prompt_len):
    """max |Δ logits| over the steps up to and including the first differing token."""
    new_ref, new_got = ref_ids[:, prompt_len:], got_ids[:, prompt_len:]
    n = new_ref.shape[1]
    differ = (new_ref != new_got).any(dim=0).nonzero()
    last = int(differ[0]) if len(differ) else n - 1
    return float((got_logits[:, : last + 1] - ref_logits[:, : last + 1]).abs().max()), last + 1


# --------------------------------------------------------------------------- fp32: same tokens


@pytest.mark.parametrize("kind", ["llama", "llama_d80", "qwen2", "mistral_window"])
def test_greedy_matches_dynamic_cache_sdpa(kind, counted, rng):
    model = make(kind)
    # Left padding: one full row, one padded, one with a single valid token.
    ids, am = left_padded(3, 13, [0, 5, 12], rng)
    new = 11
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, new, do_sample=False)
    counted["dense"] = 0
    cache = af_hf.AttnFastCache(model.config)
    got_ids, got_logits = generate(model, "attn_fast", ids, am, new, cache=cache, do_sample=False)
    assert torch.equal(got_ids, ref_ids)
    diff = float((got_logits - ref_logits).abs().max())
    assert diff <= TOL["float32"], diff
    # Every attention call went through the cache: one prefill + (new - 1) decode steps per layer.
    layers = model.config.num_hidden_layers
    assert len(counted["attend"]) == layers * new
    assert counted["dense"] == 0
    assert counted["decode"] >= layers * (new - 1)  # the one-token steps: split-KV decode kernel
    assert cache.get_seq_length() == 13 + new - 1
    lengths = cache.layers[0].kv.lengths
    if kind != "mistral_window":
        np.testing.assert_array_equal(lengths, am.sum(1).numpy() + new - 1)
    else:  # the ring keeps the window, not the whole history
        assert (lengths <= cache.layers[0].kv.capacity).all()
    print(f"{kind}: max|Δ logits| = {diff:.2e}")


def test_chunk_prefill_and_decode_kernels(counted):
    """A prompt longer than DECODE_MAX_LQ: the tiled kernel; each new token: the decode kernel."""
    model = make("llama")
    ids, am = left_padded(1, DECODE_MAX_LQ + 9, [0])
    cache = af_hf.AttnFastCache(model.config)
    generate(model, "attn_fast", ids, am, 3, cache=cache, do_sample=False)
    assert counted["forward"] == 2 and counted["decode"] == 2 * 2, counted


def test_sampling_matches(counted, rng):
    model = make("qwen2")
    ids, am = left_padded(2, 9, [0, 3], rng)
    kw = dict(do_sample=True, top_k=20, temperature=0.9, seed=7)
    ref_ids, _ = generate(model, "sdpa", ids, am, 10, **kw)
    got_ids, _ = generate(
        model, "attn_fast", ids, am, 10, cache=af_hf.AttnFastCache(model.config), **kw
    )
    assert torch.equal(got_ids, ref_ids)


@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
def test_beam_search_matches(kind, rng):
    """num_beams > 1 reorders the cache every step (reorder_cache)."""
    model = make(kind)
    ids, am = left_padded(2, 7, [0, 2], rng)
    kw = dict(do_sample=False, num_beams=3)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=9, **kw)
        model.set_attn_implementation("attn_fast")
        got = model.generate(
            input_ids=ids,
            attention_mask=am,
            max_new_tokens=9,
            cache=af_hf.AttnFastCache(model.config),
            **kw,
        )
    assert torch.equal(got, ref)


def test_past_key_values_name_and_assisted_generation(monkeypatch, rng):
    """The deprecated past_key_values= name works; assisted generation (a draft model whose
    rejected tokens are cropped from the cache) gives plain greedy's tokens."""
    model, draft = make("llama"), make("qwen2")
    ids, am = left_padded(1, 9, [0], rng)
    ref_ids, _ = generate(model, "sdpa", ids, am, 10, do_sample=False)
    model.set_attn_implementation("attn_fast")
    kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=10, min_new_tokens=10)
    with torch.no_grad(), pytest.warns(FutureWarning, match="past_key_values"):
        got = model.generate(
            **kw, do_sample=False, past_key_values=af_hf.AttnFastCache(model.config)
        )
    assert torch.equal(got, ref_ids)
    crops = []
    real_crop = af_cache.AttnFastLayer.crop
    monkeypatch.setattr(
        af_cache.AttnFastLayer,
        "crop",
        lambda self, n: (crops.append(n), real_crop(self, n))[1],
    )
    cache = af_hf.AttnFastCache(model.config)
    with torch.no_grad():
        got = model.generate(**kw, do_sample=False, cache=cache, assistant_model=draft)
    assert torch.equal(got, ref_ids)
    assert any(n < 0 for n in crops)  # the draft's rejected tokens were cropped
    assert cache.get_seq_length() == 9 + 10 - 1


# --------------------------------------------------------------------------- storage dtypes


@pytest.mark.parametrize("storage", STORAGE)
def test_reduced_precision_storage(storage, counted, rng):
    model = make("llama")
    ids, am = left_padded(2, 12, [0, 4], rng)
    new = 10
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, new, do_sample=False)
    cache = af_hf.AttnFastCache(model.config, dtype=storage)
    got_ids, got_logits = generate(model, "attn_fast", ids, am, new, cache=cache, do_sample=False)
    kv = cache.layers[0].kv
    assert kv.dtype == KVCache(1, 1, 1, capacity=1, dtype=storage).dtype
    assert cache.nbytes == sum(layer.kv.nbytes for layer in cache.layers)
    diff, steps = compared_diff(ref_ids, ref_logits, got_ids, got_logits, 12)
    assert diff <= TOL.get(storage, 0.25), (storage, diff, steps)
    assert len(counted["attend"]) == 2 * new and counted["dense"] == 0
    agree = float((got_ids[:, 12:] == ref_ids[:, 12:]).float().mean())
    print(f"{storage}: max|Δ logits| = {diff:.2e} over {steps} steps, token agreement {agree:.0%}")


def test_bfloat16_model_stores_its_dtype(rng):
    model = make("llama", dtype=torch.bfloat16)
    ids, am = left_padded(2, 12, [0, 4], rng)
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, 8, do_sample=False)
    cache = af_hf.AttnFastCache(model.config)  # dtype=None: the model's own
    got_ids, got_logits = generate(model, "attn_fast", ids, am, 8, cache=cache, do_sample=False)
    assert cache.layers[0].kv.dtype == KVCache(1, 1, 1, dtype="bfloat16").dtype
    diff, steps = compared_diff(ref_ids, ref_logits, got_ids, got_logits, 12)
    assert diff <= TOL_BF16_MODEL, (diff, steps)
    print(f"bf16 model: max|Δ logits| = {diff:.2e} over {steps} steps")


def test_float32_model_bf16_cache_halves_the_bytes():
    model = make("llama")
    ids, am = left_padded(1, 20, [0])
    caches = {dt: af_hf.AttnFastCache(model.config, dtype=dt) for dt in ("float32", "bfloat16")}
    for c in caches.values():
        generate(model, "attn_fast", ids, am, 2, cache=c, do_sample=False)
    assert caches["bfloat16"].nbytes * 2 == caches["float32"].nbytes


# --------------------------------------------------------------------------- cache state


def _step(model, tok, cache, am):
    with torch.no_grad():
        return model(input_ids=tok, attention_mask=am, cache=cache, use_cache=True).logits[:, -1]


def test_seq_length_reset_and_crop():
    model = make("llama")
    model.set_attn_implementation("attn_fast")
    ids, am = left_padded(2, 9, [0, 3])
    cache = af_hf.AttnFastCache(model.config)
    assert cache.get_seq_length() == 0
    first = _step(model, ids, cache, am)
    assert cache.get_seq_length() == 9
    np.testing.assert_array_equal(cache.layers[1].kv.lengths, [9, 6])
    tok = first.argmax(-1, keepdim=True)
    am2 = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
    nxt = _step(model, tok, cache, am2)
    assert cache.get_seq_length() == 10
    # crop: drop the last token and feed it again -> the same logits
    cache.crop(-1)
    assert cache.get_seq_length() == 9
    np.testing.assert_array_equal(cache.layers[0].kv.lengths, [9, 6])
    again = _step(model, tok, cache, am2)
    torch.testing.assert_close(again, nxt, rtol=0, atol=1e-6)
    # reset: the cache is empty and serves a new prompt as a fresh one would
    cache.reset()
    assert cache.get_seq_length() == 0
    assert all(layer.kv.lengths.tolist() == [0, 0] for layer in cache.layers)
    torch.testing.assert_close(_step(model, ids, cache, am), first, rtol=0, atol=1e-6)


def test_reorder_cache_permutes_sequences():
    model = make("llama")
    model.set_attn_implementation("attn_fast")
    ids, am = left_padded(3, 8, [0, 2, 5])
    cache = af_hf.AttnFastCache(model.config)
    _step(model, ids, cache, am)
    before = [[np.array(layer.kv.keys(b)) for b in range(3)] for layer in cache.layers]
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    for li, layer in enumerate(cache.layers):
        np.testing.assert_array_equal(layer.kv.lengths, [3, 8, 8])
        for b, src in enumerate(idx.tolist()):
            np.testing.assert_array_equal(np.array(layer.kv.keys(b)), before[li][src])
    # The next step on the reordered cache equals one on a cache of the reordered prompts.
    tok = torch.tensor([[5], [6], [7]])
    am2 = torch.cat([am[idx], torch.ones(3, 1, dtype=am.dtype)], 1)
    got = _step(model, tok, cache, am2)
    fresh = af_hf.AttnFastCache(model.config)
    _step(model, ids[idx], fresh, am[idx])
    torch.testing.assert_close(got, _step(model, tok, fresh, am2), rtol=0, atol=1e-6)
    cache.batch_repeat_interleave(2)
    assert cache.layers[0].kv.lengths.tolist() == [4, 4, 9, 9, 9, 9]
    with pytest.raises(IndexError, match="out of range"):
        cache.batch_select_indices(torch.tensor([6]))


# --------------------------------------------------------------------------- misuse


def test_other_attention_implementation_raises():
    model = make("llama")
    ids, am = left_padded(1, 5, [0])
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with pytest.raises(ValueError, match=f"attn_fast attention implementation only.*'{impl}'"):
            with torch.no_grad():
                model(input_ids=ids, attention_mask=am, cache=af_hf.AttnFastCache(model.config))


def test_bad_construction():
    with pytest.raises(TypeError, match="model's config"):
        af_hf.AttnFastCache(None)
    with pytest.raises(TypeError, match="dtype"):
        af_hf.AttnFastCache(make("llama").config, dtype="complex64")


def test_unconsumed_chunk_raises():
    cache = af_hf.AttnFastCache(make("llama").config)
    cache.config._attn_implementation = "attn_fast"
    k = torch.zeros(1, 2, 3, 16)
    cache.update(k, k, 0)
    with pytest.raises(RuntimeError, match="never attended"):
        cache.update(k, k, 0)


def test_right_padding_and_custom_mask_raise():
    model = make("llama")
    model.set_attn_implementation("attn_fast")
    ids = torch.randint(1, 128, (2, 6))
    am = torch.ones(2, 6, dtype=torch.long)
    am[1, 4:] = 0  # right padding
    with pytest.raises(ValueError, match="left padding only"):
        _step(model, ids, af_hf.AttnFastCache(model.config), am)
    layer = af_hf.AttnFastCache(model.config).layers[0]
    layer.owner = None
    q = torch.zeros(1, 4, 3, 16)
    k, v = layer.update(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16))
    custom = torch.ones(1, 1, 3, 3, dtype=torch.bool)  # a dense mask with no verified pattern
    with pytest.raises(NotImplementedError, match="custom attention_mask"):
        af_hf.attention_forward(model.model.layers[0].self_attn, q, k, v, custom)


@pytest.mark.parametrize(
    "kw, what",
    [
        (dict(softcap=30.0), "softcap"),
        (dict(s_aux=torch.zeros(4)), "sinks"),
        (dict(is_causal=False), "is_causal=False"),
    ],
)
def test_unsupported_features_raise(kw, what):
    model = make("llama")
    layer = af_hf.AttnFastCache(model.config).layers[0]
    layer.owner = None
    q = torch.zeros(1, 4, 2, 16)
    k, v = layer.update(torch.zeros(1, 2, 2, 16), torch.zeros(1, 2, 2, 16))
    with pytest.raises(NotImplementedError, match=what):
        af_hf.attention_forward(model.model.layers[0].self_attn, q, k, v, None, **kw)
    assert layer.get_seq_length() == 0 and layer.pending is None  # nothing was stored


def test_grad_through_cache_raises():
    model = make("llama")
    model.set_attn_implementation("attn_fast")
    ids, am = left_padded(1, 4, [0])
    with pytest.raises(NotImplementedError, match="inference"):
        model(
            input_ids=ids,
            attention_mask=am,
            cache=af_hf.AttnFastCache(model.config),
            use_cache=True,
        )


# --------------------------------------------------------------------------- fast paths


@pytest.mark.parametrize("cache_kind", ["dynamic", "attn_fast"])
def test_long_prompt_left_padded_batch_same_tokens_as_sdpa(cache_kind, rng):
    """Greedy decoding after a 70-token prompt (above the decode kernel's key threshold for
    short chunks), three rows left-padded differently: transformers' DynamicCache read in place
    and AttnFastCache both give sdpa's tokens in float32, logits within TOL."""
    model = make("llama")
    ids, am = left_padded(3, 70, [0, 9, 41], rng)
    new = 8
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, new, do_sample=False)
    cache = af_hf.AttnFastCache(model.config) if cache_kind == "attn_fast" else None
    got_ids, got_logits = generate(model, "attn_fast", ids, am, new, cache=cache, do_sample=False)
    assert torch.equal(got_ids, ref_ids)
    assert float((got_logits - ref_logits).abs().max()) <= TOL["float32"]


def test_implementation_checked_at_every_forward_pass():
    """The attention-implementation check runs once per forward pass (at layer 0's update),
    so switching the model away from attn_fast between two passes still raises."""
    model = make("llama")
    ids, am = left_padded(1, 6, [0])
    cache = af_hf.AttnFastCache(model.config)
    with torch.no_grad():
        model.set_attn_implementation("attn_fast")
        model(input_ids=ids, attention_mask=am, cache=cache, use_cache=True)
        model.set_attn_implementation("sdpa")
        with pytest.raises(ValueError, match="attn_fast attention implementation only.*'sdpa'"):
            model(
                input_ids=ids[:, :1], attention_mask=torch.ones(1, 7, dtype=torch.long), cache=cache
            )


def test_mask_padding_derived_once_yet_checked_per_layer():
    """What a mask's key padding implies is computed once per mask, but each layer still
    compares it with its own stored counts: a layer whose counts differ raises."""
    model = make("llama")
    ids, am = left_padded(2, 7, [0, 3])
    cache = af_hf.AttnFastCache(model.config)
    model.set_attn_implementation("attn_fast")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=am, cache=cache, use_cache=True)
        cache.layers[1].valid = cache.layers[1].valid + 1  # as if layer 1 held other tokens
        am2 = torch.cat([am, torch.ones(2, 1, dtype=am.dtype)], 1)
        with pytest.raises(ValueError, match="valid past tokens"):
            model(input_ids=ids[:, -1:], attention_mask=am2, cache=cache, use_cache=True)


def test_cache_module_does_not_import_the_backend_module():
    """transformers_cache and transformers meet in _hf_shared (no import cycle): importing the
    cache module alone leaves the backend module unimported, and the cache recognises the
    backend by the mark on its attention function."""
    import subprocess
    import sys

    code = (
        "import sys; import attn_fast.integrations.transformers_cache as c; "
        "print('attn_fast.integrations.transformers' in sys.modules); "
        "import attn_fast.integrations.transformers as t; "
        "from attn_fast.integrations._hf_shared import is_backend; "
        "print(is_backend(t.attention_forward), is_backend(lambda *a: None))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True", "False"], out


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral_window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pads", [[0], [0, 0], [0, 4]], ids=["B1", "B2", "B2pad"])
def test_one_call_step_same_bits_as_store_and_attend(monkeypatch, kind, dtype, pads):
    """A generated token without mask takes AttnFastLayer.step (store and attend in one C
    call); its logits are attend_cached's bit for bit (step switched off). A padded batch
    and a sliding-window model have a mask: attend_cached, both times."""
    model = make(kind, dtype=dtype)
    ids, am = left_padded(len(pads), 11, pads)
    new, layers = 6, model.config.num_hidden_layers
    real, taken = af_cache.AttnFastLayer.step, []

    def step(self, *a):
        o = real(self, *a)
        taken.append(o is not None)
        return o

    monkeypatch.setattr(af_cache.AttnFastLayer, "step", step)
    got = generate(model, "attn_fast", ids, am, new, cache=af_hf.AttnFastCache(model.config))
    masked = any(pads) or kind == "mistral_window"
    assert sum(taken) == (0 if masked else layers * (new - 1)), taken
    monkeypatch.setattr(af_cache.AttnFastLayer, "step", lambda self, *a: None)
    ref = generate(model, "attn_fast", ids, am, new, cache=af_hf.AttnFastCache(model.config))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
