"""attn_fast as a Hugging Face transformers attention backend, end to end.

Small models built from random configs (no downloads) run once with
transformers' own implementation and once with "attn_fast"; hidden states /
logits must agree at every non-padding position within float32 rounding
(TOL below: |Δ| <= 2e-5 + 2e-4·|ref|; observed differences are ~1e-7), and
greedy generate() must give the same tokens. Every test counts the calls that
reach attn_fast (one per layer per forward pass) so a silent fallback to
another implementation cannot pass, and records which kernel arguments each
call used (flags vs a dense mask).

The reference is "sdpa" except for features the sdpa backend does not have
(softcap, sinks): there it is "eager".
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
from attn_fast import _checks  # noqa: E402

TOL = dict(rtol=2e-4, atol=2e-5)


@pytest.fixture(autouse=True)
def _registered():
    af_hf.register()
    torch.manual_seed(0)


@pytest.fixture
def calls(monkeypatch):
    """Every call the backend makes into attn_fast, with the arguments that decide the mask."""
    seen = []
    real = F.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, **kw):
        seen.append(
            dict(
                q=tuple(q.shape),
                k=tuple(k.shape),
                is_causal=is_causal,
                enable_gqa=enable_gqa,
                dtypes=tuple(x.dtype for x in (q, k, v)),
                mask=None if attn_mask is None else tuple(np.shape(attn_mask)),
                window=kw.get("window_size"),
                softcap=kw.get("softcap"),
                sinks=kw.get("sinks") is not None,
            )
        )
        return real(
            q,
            k,
            v,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            **kw,
        )

    real_step = af_hf._decode_step

    def counting_step(q, k, v, scaling, causal, runs=None, window=(-1, -1)):
        # The one-token fast path (plain scores, no mask or padding as runs of valid keys): the
        # decode kernel, not F's entry point.
        seen.append(
            dict(
                q=tuple(q.shape),
                k=tuple(k.shape),
                is_causal=causal,
                enable_gqa=k.shape[1] != q.shape[1],
                dtypes=tuple(x.dtype for x in (q, k, v)),
                mask=None if runs is None else (q.shape[0], 1, 1, k.shape[2]),
                window=None if window == (-1, -1) else window,
                softcap=None,
                sinks=False,
                fast=True,
            )
        )
        return real_step(q, k, v, scaling, causal, runs, window)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    monkeypatch.setattr(af_hf, "_decode_step", counting_step)
    return seen


def run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs)


def greedy(model, impl, ids, am, new, **kw):
    """Greedy generate(): (token ids, per-step logits (B, new, vocab))."""
    model.set_attn_implementation(impl)
    with torch.no_grad():
        g = model.generate(
            input_ids=ids,
            attention_mask=am.bool(),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return g.sequences, torch.stack(g.logits, dim=1)


def same_generation(model, ids, am, new, **kw):
    """attn_fast and sdpa generate the same tokens, with the same logits at every step."""
    ref_ids, ref_logits = greedy(model, "sdpa", ids, am, new, **kw)
    got_ids, got_logits = greedy(model, "attn_fast", ids, am, new, **kw)
    assert torch.equal(got_ids, ref_ids), (got_ids, ref_ids)
    return close(got_logits, ref_logits, torch.ones(got_logits.shape[:2], dtype=torch.bool))


def close(a, b, valid):
    """Assert agreement at valid (non-padding) positions; return the max |difference|."""
    a, b = a[valid].numpy(), b[valid].numpy()
    np.testing.assert_allclose(a, b, **TOL)
    return float(np.abs(a - b).max())


def padded_batch(B, L, vocab, left, pads):
    """Token ids and a 2-D attention mask with pads[b] padding tokens
    on the left or right of row b."""
    ids = torch.randint(1, vocab, (B, L))
    am = torch.ones(B, L, dtype=torch.long)
    for b, p in enumerate(pads):
        if p:
            am[b, :p] = 0 if left else 1
            am[b, L - p :] = 1 if left else 0
    return ids, am


# --------------------------------------------------------------------------- encoder


def bert(**kw):
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        **kw,
    )
    return transformers.BertModel(cfg).eval()


def test_bert_encoder_padded_batch(calls):
    model = bert()
    ids, am = padded_batch(
        3, 19, 100, left=False, pads=[0, 7, 18]
    )  # right padding, one row with one token
    ref = run(model, "sdpa", input_ids=ids, attention_mask=am).last_hidden_state
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).last_hidden_state
    diff = close(got, ref, am.bool())
    assert len(calls) == 2, calls  # one per layer
    # Bidirectional + key padding: no causal flag, the padding as a (B, 1, 1, Lk) broadcast mask.
    assert all(c["mask"] == (3, 1, 1, 19) and not c["is_causal"] for c in calls), calls
    print(f"bert padded max|Δ| = {diff:.2e}")


def test_bert_encoder_no_padding_and_float64(calls):
    model = bert().double()
    ids = torch.randint(0, 100, (2, 33))
    ref = run(model, "sdpa", input_ids=ids).last_hidden_state
    got = run(model, "attn_fast", input_ids=ids).last_hidden_state
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-10, atol=1e-11)
    assert len(calls) == 2 and all(c["mask"] is None and not c["is_causal"] for c in calls), calls


# --------------------------------------------------------------------------- decoders


def llama(**kw):
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        **kw,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def test_llama_gqa_prefill_left_padding(calls):
    model = llama()
    ids, am = padded_batch(3, 17, 128, left=True, pads=[0, 5, 16])
    ref = run(model, "sdpa", input_ids=ids, attention_mask=am).logits
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).logits
    diff = close(got, ref, am.bool())
    assert len(calls) == 2, calls
    for c in calls:  # GQA without repeating K/V; causal as a flag plus the padding as keys
        assert c["enable_gqa"] and c["q"][1] == 4 and c["k"][1] == 2
        assert c["is_causal"] and c["mask"] == (3, 1, 1, 17), c
    print(f"llama padded max|Δ| = {diff:.2e}")


def test_llama_no_padding_uses_flags_only(calls):
    model = llama()
    ids = torch.randint(1, 128, (2, 40))
    ref = run(model, "sdpa", input_ids=ids).logits
    got = run(model, "attn_fast", input_ids=ids).logits
    close(got, ref, torch.ones(2, 40, dtype=torch.bool))
    assert len(calls) == 2 and all(c["is_causal"] and c["mask"] is None for c in calls), calls


def test_llama_greedy_generate_same_tokens(calls):
    model = llama()
    ids, am = padded_batch(2, 9, 128, left=True, pads=[0, 3])
    new = 12
    diff = same_generation(model, ids, am, new)
    print(f"llama generate logits max|Δ| = {diff:.2e}")
    assert len(calls) == 2 * new, len(
        calls
    )  # prefill + (new - 1) one-token decode steps, per layer
    decode = [c for c in calls if c["q"][2] == 1]
    assert len(decode) == 2 * (new - 1)
    # One-token decode against transformers' KV cache: all Lk cached keys, left padding as a key
    # mask.
    assert [c["k"][2] for c in decode[::2]] == list(range(10, 9 + new))
    assert all(c["mask"] == (2, 1, 1, c["k"][2]) for c in decode), decode


def test_llama_kv_cache_decode_matches_full_forward(calls):
    # Prefill 11 tokens, then 3 steps of one token each against the DynamicCache,
    # versus one full causal forward over all 14 (bottom-right alignment).
    model = llama()
    model.set_attn_implementation("attn_fast")
    ids = torch.randint(1, 128, (2, 14))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :11], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for t in range(11, 14):
            out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    close(torch.cat(steps, dim=1), full, torch.ones(2, 14, dtype=torch.bool))
    assert len(calls) == 2 * 5
    # A 3-token chunk against a cache of 11: Lq=3 < Lk=14, causal aligned bottom-right.
    with torch.no_grad():
        out = model(input_ids=ids[:, :11], use_cache=True)
        chunk = model(input_ids=ids[:, 11:], cache=out.cache, use_cache=True).logits
    close(chunk, full[:, 11:], torch.ones(2, 3, dtype=torch.bool))
    assert calls[-1]["q"][2] == 3 and calls[-1]["k"][2] == 14 and calls[-1]["is_causal"], calls[-1]


def test_static_cache_generate(calls):
    # StaticCache: keys beyond the filled length are empty slots; the mask must hide them.
    model = llama()
    ids, am = padded_batch(2, 7, 128, left=True, pads=[0, 2])
    same_generation(model, ids, am, 5, cache_implementation="static")
    assert len(calls) == 2 * 5
    # The cache holds 7 + 5 - 1 = 11 slots from the start, and every call sees all of them: the
    # prefill through
    # the dense (B, 1, 7, 11) mask (top-left causal, empty slots hidden), each decode step through a
    # causal
    # flag and a (B, 1, 1, 11) key mask hiding the padding and the slots not yet written.
    assert all(c["k"][2] == 11 for c in calls), calls
    assert [c["mask"] for c in calls[:2]] == [(2, 1, 7, 11)] * 2 and not calls[0]["is_causal"], (
        calls
    )
    assert all(c["mask"] == (2, 1, 1, 11) and c["is_causal"] for c in calls[2:]), calls


def mistral():
    cfg = transformers.MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        sliding_window=6,
        pad_token_id=0,
    )
    return transformers.MistralForCausalLM(cfg).eval()


def test_sliding_window_prefill_and_generate(calls):
    model = mistral()
    ids, am = padded_batch(2, 21, 128, left=True, pads=[0, 4])
    ref = run(model, "sdpa", input_ids=ids, attention_mask=am).logits
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).logits
    diff = close(got, ref, am.bool())
    assert len(calls) == 2 and all(c["window"] == (5, -1) and c["is_causal"] for c in calls), calls
    print(f"mistral sliding window max|Δ| = {diff:.2e}")
    calls.clear()
    same_generation(model, ids, am, 8)
    assert len(calls) == 2 * 8
    # The sliding-window cache keeps the last window - 1 keys: decode steps see Lk = 6.
    assert all(c["k"][2] == 6 for c in calls if c["q"][2] == 1), calls


def gemma2():
    """A 2-layer Gemma2: logit softcapping, sliding window 5 on alternating layers."""
    cfg = transformers.Gemma2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=5,
        attn_logit_softcapping=2.0,
        query_pre_attn_scalar=16,
        pad_token_id=0,
    )
    return transformers.Gemma2ForCausalLM(cfg)


def gpt_oss():
    """A 2-layer gpt-oss: attention sinks (drawn at random, not zero), sliding window 4."""
    cfg = transformers.GptOssConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        max_position_embeddings=131072,  # = 32 x 4096, the YaRN factor of the default config
        pad_token_id=0,
    )
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    return model


def test_gemma2_softcap_and_alternating_windows(calls):
    model = gemma2().eval()
    ids, am = padded_batch(2, 13, 128, left=True, pads=[0, 3])
    ref = run(model, "eager", input_ids=ids, attention_mask=am).logits  # sdpa has no softcap
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).logits
    diff = close(got, ref, am.bool())
    assert len(calls) == 2 and all(c["softcap"] == 2.0 for c in calls), calls
    # one sliding, one full layer
    assert sorted(str(c["window"]) for c in calls) == ["(4, -1)", "None"], calls
    print(f"gemma2 softcap max|Δ| = {diff:.2e}")


def test_gpt_oss_sinks(calls):
    model = gpt_oss().eval()
    ids, am = padded_batch(2, 11, 128, left=True, pads=[0, 2])
    ref = run(model, "eager", input_ids=ids, attention_mask=am).logits
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).logits
    close(got, ref, am.bool())
    assert len(calls) == 2 and all(c["sinks"] for c in calls), calls


def test_t5_position_bias_encoder_decoder(calls):
    cfg = transformers.T5Config(
        vocab_size=100,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    ids, am = padded_batch(2, 10, 100, left=False, pads=[0, 3])
    dec = torch.randint(1, 100, (2, 6))
    ref = run(model, "sdpa", input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am, decoder_input_ids=dec).logits
    close(got, ref, torch.ones(2, 6, dtype=torch.bool))
    assert len(calls) == 2 + 2 * 2, calls  # encoder self; decoder self + cross


def test_user_4d_float_mask(calls):
    # A caller-built additive 4-D mask is passed through as is and read densely.
    model = llama()
    ids = torch.randint(1, 128, (1, 8))
    allowed = torch.rand(8, 8) < 0.6
    allowed |= torch.eye(8, dtype=torch.bool)
    add = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    ref = run(model, "sdpa", input_ids=ids, attention_mask=add).logits
    got = run(model, "attn_fast", input_ids=ids, attention_mask=add).logits
    close(got, ref, torch.ones(1, 8, dtype=torch.bool))
    assert len(calls) == 2 and all(c["mask"] == (1, 1, 8, 8) and not c["is_causal"] for c in calls)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_model_computed_in_its_dtype(calls, dtype):
    """q, k, v reach the kernel in the model's dtype (no upcast copy) and the output is in it too;
    logits agree with sdpa in the same dtype up to the rounding of the rest of the model."""
    model = llama().to(dtype)
    ids, am = padded_batch(2, 12, 128, left=True, pads=[0, 4])
    ref = run(model, "sdpa", input_ids=ids, attention_mask=am).logits.float()
    got = run(model, "attn_fast", input_ids=ids, attention_mask=am).logits
    assert got.dtype == dtype and len(calls) == 2
    assert all(c["dtypes"] == (dtype,) * 3 for c in calls), calls
    valid = am.bool()
    np.testing.assert_allclose(got.float()[valid].numpy(), ref[valid].numpy(), atol=0.1)


def test_bfloat16_llama_greedy_generate_matches_sdpa(calls):
    """A tiny bf16 Llama (from a config) generates greedily through attn_fast's bf16 prefill and
    decode kernels: the same tokens as "sdpa" in bf16, and logits within bf16 rounding."""
    model = llama().to(torch.bfloat16)
    ids, am = padded_batch(2, 9, 128, left=True, pads=[0, 3])
    new = 8
    ref_ids, ref_logits = greedy(model, "sdpa", ids, am, new)
    got_ids, got_logits = greedy(model, "attn_fast", ids, am, new)
    assert len(calls) == 2 * new and all(c["dtypes"] == (torch.bfloat16,) * 3 for c in calls)
    agree = float((got_ids[:, 9:] == ref_ids[:, 9:]).float().mean())
    print(f"bf16 llama greedy tokens agreeing with sdpa: {agree:.0%}")
    assert torch.equal(got_ids, ref_ids), (got_ids, ref_ids)
    np.testing.assert_allclose(got_logits.float().numpy(), ref_logits.float().numpy(), atol=0.1)


def test_bfloat16_training_backward_in_bf16(calls):
    """Training a bf16 model: the forward and the fused backward in bf16 (no upcast copy; fp32
    accumulation inside the kernels); gradients in bf16, close to sdpa's bf16 gradients."""
    model = llama().to(torch.bfloat16)
    ids, am = padded_batch(2, 10, 128, left=True, pads=[0, 3])
    labels = lm_labels(ids, am)
    ref_loss, ref = grads(model, "sdpa", input_ids=ids, attention_mask=am, labels=labels)
    got_loss, got = grads(model, "attn_fast", input_ids=ids, attention_mask=am, labels=labels)
    assert len(calls) == 2 and all(c["dtypes"] == (torch.bfloat16,) * 3 for c in calls), calls
    assert got.keys() == ref.keys()
    assert abs(got_loss - ref_loss) <= 2e-2 * abs(ref_loss)
    for name in ref:
        assert got[name].dtype == torch.bfloat16, name
        a, b = got[name].float().numpy(), ref[name].float().numpy()
        scale = max(float(np.abs(b).max()), 1e-6)
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05 * scale, err_msg=name)


# --------------------------------------------------------------------------- what it refuses


def test_refuses_what_it_cannot_do_exactly():
    model = llama(attention_dropout=0.1)
    ids = torch.randint(1, 128, (1, 6))
    model.set_attn_implementation("attn_fast")
    model.train()
    with pytest.raises(NotImplementedError, match="no attention dropout"):
        model(input_ids=ids)
    model.eval()
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions=True"):
        model(input_ids=ids, output_attentions=True)
    # Forward with grad enabled and backward work (see the training tests below).
    model(input_ids=ids).logits.sum().backward()
    q = torch.ones(1, 2, 3, 8, device="meta")
    with pytest.raises(TypeError, match="CPU only"):
        af_hf.attention_forward(model.model.layers[0].self_attn, q, q, q, None)


def test_register_and_from_pretrained_name(tmp_path, calls):
    assert af_hf.register() == "attn_fast"
    assert "attn_fast" in transformers.AttentionInterface().valid_keys()
    assert "attn_fast" in transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    model = llama()
    model.save_pretrained(tmp_path)
    loaded = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation="attn_fast"
    ).eval()
    assert loaded.config._attn_implementation == "attn_fast"
    with torch.no_grad():
        loaded(input_ids=torch.randint(1, 128, (1, 5)))
    assert len(calls) == 2


# ------------------------------------------------------------------------- the two halves, directly


class _Module(torch.nn.Module):
    def __init__(self, is_causal, groups=1):
        super().__init__()
        self.is_causal, self.num_key_value_groups = is_causal, groups


def torch_reference(q, k, v, dense, scale=None):
    """float64 torch attention with a dense bool mask; rows that see no key -> 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    s = s.masked_fill(~dense, -torch.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


MU = transformers.masking_utils


@pytest.mark.parametrize(
    "Lq, Lk, q_off, kv_off, window, pad, fn, kind",
    [
        (9, 9, 0, 0, None, None, "causal", "none"),  # plain prefill: no mask, causal flag
        (9, 9, 0, 0, None, "left", "causal", "flags"),
        (1, 12, 11, 0, None, None, "causal", "none"),  # decode: no mask
        (1, 12, 11, 0, None, "left", "causal", "flags"),
        (4, 12, 8, 0, None, "right", "causal", "flags"),  # chunked prefill against a cache
        (
            5,
            12,
            0,
            0,
            None,
            "right",
            "causal",
            "dense",
        ),  # static cache prefill: top-left, empty slots
        (9, 9, 0, 0, 4, "left", "sliding", "flags"),  # Mistral sliding window
        (1, 6, 20, 15, 6, None, "sliding", "flags"),  # sliding-window cache, full
        (3, 8, 17, 12, 6, "left", "sliding", "flags"),
        (7, 7, 0, 0, None, "right", "bidirectional", "flags"),
        (7, 7, 0, 0, 2, "right", "bidir_sliding", "flags"),
        (6, 11, 0, 0, None, "right", "bidirectional", "flags"),  # cross-attention sizes
        (
            8,
            8,
            0,
            0,
            3,
            None,
            "chunked",
            "dense",
        ),  # Llama 4 chunks: no flag description, read densely
    ],
)
def test_mask_builder_matches_transformers_sdpa_mask(
    calls, Lq, Lk, q_off, kv_off, window, pad, fn, kind
):
    # kind: what the builder should return: "none" (no mask), "flags" (verified description),
    # "dense".
    B, H, Hkv, d = 3, 4, 2, 8
    g = torch.Generator().manual_seed(Lq * 100 + Lk + q_off)
    total = kv_off + Lk
    padding = torch.ones(B, total, dtype=torch.bool)
    if pad == "left":
        padding[1, :3], padding[2, : total - 1] = False, False
    elif pad == "right":
        padding[1, -2:], padding[2, 1:] = False, False
    mask_fn = {
        "causal": MU.causal_mask_function,
        "sliding": MU.sliding_window_causal_mask_function(window or 1),
        "bidirectional": MU.bidirectional_mask_function,
        "bidir_sliding": MU.sliding_window_bidirectional_mask_function(window or 1),
        "chunked": MU.chunked_causal_mask_function(window or 1, torch.zeros(B, dtype=torch.long)),
    }[fn]
    kw = dict(
        batch_size=B,
        q_length=Lq,
        kv_length=Lk,
        q_offset=q_off,
        kv_offset=kv_off,
        mask_function=mask_fn,
        attention_mask=None if pad is None else padding,
        local_size=window,
    )
    dense = MU.sdpa_mask(**kw, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    ours = af_hf.attention_mask(**kw, allow_is_causal_skip=True, allow_is_bidirectional_skip=True)
    q = torch.randn(B, H, Lq, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Lk, d, generator=g, dtype=torch.float64) for _ in range(2))
    module = _Module(is_causal=fn in ("causal", "sliding", "chunked"), groups=H // Hkv)
    got, _ = af_hf.attention_forward(module, q, k, v, ours)
    expect = torch_reference(q, k, v, dense)
    np.testing.assert_allclose(got.numpy(), expect.numpy(), rtol=1e-10, atol=1e-12)
    assert len(calls) == 1
    got_kind = "none" if ours is None else "flags" if hasattr(ours, "_attn_fast_spec") else "dense"
    assert got_kind == kind
    if kind == "flags":
        assert calls[0]["mask"] in (None, (B, 1, 1, Lk)), (
            calls
        )  # flags + key padding, never the dense mask
    if kind == "dense":
        assert calls[0]["mask"] == (B, 1, Lq, Lk) and not calls[0]["is_causal"], calls


@pytest.mark.parametrize("Lq, Lk", [(3, 7), (5, 3), (1, 6), (6, 6)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "position_bias"])
def test_no_mask_matches_transformers_sdpa_backend(calls, Lq, Lk, with_bias):
    # A causal module called without a mask: the sdpa backend's semantics (torch's top-left
    # is_causal).
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(Lq * 10 + Lk)
    q = torch.randn(2, 4, Lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, Lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    pb = torch.randn(1, 4, Lq, Lk, generator=g, dtype=torch.float64) if with_bias else None
    module = _Module(is_causal=True)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, position_bias=pb)
    got, _ = af_hf.attention_forward(module, q, k, v, None, position_bias=pb)
    np.testing.assert_allclose(got.numpy(), ref.numpy(), rtol=1e-10, atol=1e-12)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Lk", [64, 301])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("views", ["c", "python"])
def test_one_token_fast_path_same_bits_as_the_entry_point(
    calls, monkeypatch, dtype, Lk, causal, views
):
    """A decode step without a mask takes _decode_step (the decode kernel on the tensors'
    memory): the same bits as attn_fast.scaled_dot_product_attention, which picks the decode
    kernel for it too, here on strided key/value views as transformers' caches hold them;
    the tensors read by _core.tensor_views or, where it declines, by fast_view."""
    if views == "python":
        monkeypatch.setattr(af_hf._core, "tensor_views", lambda *a: None)
    g = torch.Generator().manual_seed(Lk + 7 * causal)
    q = torch.randn(2, 8, 1, 64, generator=g).to(dtype)
    kbuf, vbuf = (torch.randn(2, 2, Lk + 5, 64, generator=g).to(dtype) for _ in range(2))
    k, v = kbuf[:, :, :Lk], vbuf[:, :, :Lk]  # views with a longer row stride per head
    _checks._is_torch_tensor(q)  # torch's kinds handed to _core (a first call does it)
    assert (af_hf._core.tensor_views(q, k, v) is None) == (views == "python")
    got, _ = af_hf.attention_forward(_Module(is_causal=causal), q, k, v, None, scaling=0.125)
    assert [c.get("fast") for c in calls] == [True]
    want = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
    assert got.shape == (2, 1, 8, 64) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, want.transpose(1, 2))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=0.125, enable_gqa=True
    )
    tol = TOL if dtype in (torch.float32, torch.float64) else dict(rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(got.transpose(1, 2).double().numpy(), ref.numpy(), **tol)


@pytest.mark.parametrize(
    "kshape, vshape, match",
    [
        ((1, 4, 100, 64), (1, 4, 100, 64), "not a multiple of k/v's 4 heads"),
        ((1, 2, 100, 32), (1, 2, 100, 32), r"k has shape \(1, 2, 100, 32\) but q has head dim 64"),
        ((2, 2, 100, 64), (2, 2, 100, 64), "batch sizes differ"),
        ((1, 2, 100, 64), (1, 2, 99, 64), r"v has shape \(1, 2, 99, 64\)"),
    ],
)
def test_one_token_bad_shapes_name_them(kshape, vshape, match):
    """Shapes the fast path cannot read go through the entry point, whose errors name them."""
    q = torch.randn(1, 6, 1, 64)
    with pytest.raises(ValueError, match=match):
        af_hf.attention_forward(
            _Module(is_causal=True), q, torch.randn(kshape), torch.randn(vshape), None
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_padding_as_key_runs(calls, dtype):
    """A one-token step of a padded batch: the mask builder's key mask, one run of valid keys
    per row (left padding, right padding, a row with none, a full row), becomes kv_start /
    kv_lens of the decode kernel; a key mask with holes takes the generic path. Both agree
    with a float64 reference on the same mask."""
    from transformers.masking_utils import causal_mask_function

    B, Hq, Hkv, Lk, d = 4, 8, 2, 200, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, Lk, d, generator=g).to(dtype) for _ in range(2))
    for holes in (False, True):
        am = torch.ones(B, Lk, dtype=torch.long)
        am[0, :37] = 0  # left padding
        am[1, 150:] = 0  # right padding
        am[2, :] = 0  # no valid key: zeros
        if holes:
            am[3, 10:20] = 0  # not one run: the generic path
        mask = af_hf.attention_mask(
            batch_size=B,
            q_length=1,
            kv_length=Lk,
            q_offset=Lk - 1,
            mask_function=causal_mask_function,
            attention_mask=am.bool(),
        )
        calls.clear()
        got, _ = af_hf.attention_forward(_Module(is_causal=True), q, k, v, mask, scaling=0.125)
        assert [c.get("fast", False) for c in calls] == [not holes]
        keep = am.bool()[:, None, None, :]
        ref = torch_reference(q.double(), k.double(), v.double(), keep, scale=0.125)
        tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
        np.testing.assert_allclose(got.double().numpy(), ref.numpy(), **tol)
        assert not got[2].any()  # the row without a valid key


@pytest.mark.parametrize("pads", [[0], [0, 3]], ids=["one", "left-padded"])
def test_one_token_sliding_window_layer(calls, pads):
    """A sliding-window layer's one-token step against 100 cached keys: without padding the
    fast path reads the window as the decode kernel's window_size; with padding (no key runs
    with a window) the generic path does. Both match a float64 reference of the window."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    B, Lk, w = len(pads), 100, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 4, 1, 32, generator=g)
    k, v = (torch.randn(B, 2, Lk, 32, generator=g) for _ in range(2))
    am = torch.ones(B, Lk, dtype=torch.long)
    for b, p in enumerate(pads):
        am[b, :p] = 0
    mask = af_hf.attention_mask(
        batch_size=B,
        q_length=1,
        kv_length=Lk,
        q_offset=Lk - 1,
        mask_function=sliding_window_causal_mask_function(w),
        attention_mask=am.bool(),
        local_size=w,  # as transformers passes it for a sliding-window layer
    )
    got, _ = af_hf.attention_forward(_Module(is_causal=True), q, k, v, mask, scaling=0.2)
    assert [c.get("fast", False) for c in calls] == [not any(pads)]
    assert calls[0]["window"] == (w - 1, -1), calls
    pos = torch.arange(Lk)
    keep = am.bool() & (pos >= Lk - w)
    ref = torch_reference(q.double(), k.double(), v.double(), keep[:, None, None, :], scale=0.2)
    np.testing.assert_allclose(got.double().numpy(), ref.numpy(), **TOL)


@pytest.mark.parametrize("pads", [[0], [0, 5]], ids=["one", "left-padded"])
def test_llama_long_prompt_generate_takes_the_fast_path(calls, pads):
    """Greedy generate() after a 70-token prompt: every one-token step (>= 64 cached keys;
    left padding as runs of valid keys) runs the fast path, and the tokens and logits are
    sdpa's."""
    model = llama()
    ids, am = padded_batch(len(pads), 70, 128, left=True, pads=pads)
    new = 6
    same_generation(model, ids, am, new)
    decode = [c for c in calls if c["q"][2] == 1]
    assert len(decode) == 2 * (new - 1) and all(c.get("fast") for c in decode), decode
    assert [c["k"][2] for c in decode[::2]] == list(range(71, 70 + new))
    padded = any(pads)
    assert all((c["mask"] is not None) == padded for c in decode), decode


# --------------------------------------------------------------------------- training


def grads(model, impl, **inputs):
    """loss and {name: grad} of one training forward/backward with `impl`."""
    model.set_attn_implementation(impl)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def lm_labels(ids, am):
    """Labels with -100 on padding and where the predicting position is padding
    (left padding: the first real token), so no loss term reads a fully masked
    query row (backends differ there)."""
    prev = torch.cat([torch.ones_like(am[:, :1]), am[:, :-1]], dim=1)
    return ids.masked_fill((am == 0) | (prev == 0), -100)


def same_grads(model, ref_impl, **inputs):
    ref_loss, ref = grads(model, ref_impl, **inputs)
    got_loss, got = grads(model, "attn_fast", **inputs)
    assert got.keys() == ref.keys()
    assert abs(got_loss - ref_loss) <= 1e-5 * abs(ref_loss)
    worst = 0.0
    for name in ref:
        a, b = got[name].numpy(), ref[name].numpy()
        scale = max(float(np.abs(b).max()), 1e-6)
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5 * scale, err_msg=name)
        worst = max(worst, float(np.abs(a - b).max()) / scale)
    return worst


def test_llama_training_gradients_match_sdpa(calls):
    model = llama()
    ids, am = padded_batch(3, 14, 128, left=True, pads=[0, 4, 9])
    labels = lm_labels(ids, am)
    worst = same_grads(model, "sdpa", input_ids=ids, attention_mask=am, labels=labels)
    assert len(calls) == 2, calls  # the attn_fast pass: one call per layer, with its backward
    print(f"llama training max|Δgrad|/max|grad| = {worst:.2e}")


def test_llama_training_steps_same_losses_as_sdpa(calls):
    import copy

    base = llama()
    ids, am = padded_batch(2, 12, 128, left=False, pads=[0, 5])
    labels = lm_labels(ids, am)
    losses = {}
    for impl in ("sdpa", "attn_fast"):
        model = copy.deepcopy(base)
        model.set_attn_implementation(impl)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses[impl] = []
        for _ in range(4):
            opt.zero_grad()
            loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
            loss.backward()
            opt.step()
            losses[impl].append(float(loss.detach()))
    assert losses["sdpa"][-1] < losses["sdpa"][0]  # the steps do train
    np.testing.assert_allclose(losses["attn_fast"], losses["sdpa"], rtol=1e-5)
    assert len(calls) == 4 * 2


def test_gemma2_softcap_window_training_gradients_match_eager(calls):
    model = gemma2()
    ids, am = padded_batch(2, 13, 128, left=True, pads=[0, 3])
    same_grads(model, "eager", input_ids=ids, attention_mask=am, labels=lm_labels(ids, am))
    assert len(calls) == 2 and all(c["softcap"] == 2.0 for c in calls), calls


def test_gpt_oss_sinks_training_gradients_match_eager(calls):
    model = gpt_oss()
    ids, am = padded_batch(2, 11, 128, left=True, pads=[0, 2])
    same_grads(model, "eager", input_ids=ids, attention_mask=am, labels=lm_labels(ids, am))
    assert len(calls) == 2 and all(c["sinks"] for c in calls), calls
    assert all(layer.self_attn.sinks.grad is not None for layer in model.model.layers)
