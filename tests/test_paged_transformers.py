"""AttnFastPagedCache: a transformers Cache whose layers are PagedKVCache pools, end to end.

The small random-weight decoders of tests/test_transformers_cache.py generate with
transformers' DynamicCache + "sdpa" (the reference), with the contiguous AttnFastCache and
with AttnFastPagedCache. float32 storage: the same tokens as both, logits within 1e-5 of
sdpa's (the paged cache runs the split-KV decode kernel for the prefill too, so its logits
agree with the contiguous cache's to float32 rounding, not bit for bit). Reduced precision:
logits within the contiguous cache's tolerances up to the first differing token; the int8
token agreement with the float32 run is printed (``-s``) and loosely bounded.
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

from test_transformers_cache import (  # noqa: E402
    TOL,
    TOL_BF16_MODEL,
    _step,
    compared_diff,
    generate,
    install_call_counters,
    left_padded,
    make,
)

import attn_fast.integrations.transformers as af_hf  # noqa: E402
import attn_fast.integrations.transformers_cache as af_cache  # noqa: E402
import attn_fast.paged_cache as pgc  # noqa: E402
from attn_fast import PagedKVCache  # noqa: E402


@pytest.fixture(autouse=True)
def _registered():
    af_hf.register()
    torch.manual_seed(0)


@pytest.fixture
def counted(monkeypatch):
    """Counts PagedKVCache.attend calls, paged decode kernel calls and dense attn_fast calls."""
    seen = {"attend": 0, "paged": 0, "dense": 0}

    def on_attend(*args):
        seen["attend"] += 1

    return install_call_counters(
        monkeypatch, pgc.PagedKVCache, seen, on_attend, {"decode": "paged"}
    )


KINDS = ["llama", "llama_d80", "qwen2", "mistral_window", "mistral_window_70"]


def model_of(kind):
    if kind == "mistral_window_70":  # a window longer than a block: blocks released mid-run
        model = make("mistral_window")
        model.config.sliding_window = 70
        return model
    return make(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_sdpa_and_the_contiguous_cache(kind, counted, rng):
    model = model_of(kind)
    long = kind == "mistral_window_70"
    L, new = (100, 40) if long else (13, 11)
    ids, am = left_padded(3, L, [0, 5, L - 1], rng)
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, new, do_sample=False)
    flat_ids, _ = generate(
        model, "attn_fast", ids, am, new, cache=af_hf.AttnFastCache(model.config), do_sample=False
    )
    counted.update(attend=0, paged=0, dense=0)
    cache = af_cache.AttnFastPagedCache(model.config, block_size=64)
    got_ids, got_logits = generate(model, "attn_fast", ids, am, new, cache=cache, do_sample=False)
    assert torch.equal(got_ids, ref_ids)
    assert torch.equal(got_ids, flat_ids)
    diff = float((got_logits - ref_logits).abs().max())
    assert diff <= TOL["float32"], diff
    layers = model.config.num_hidden_layers
    assert counted["attend"] == layers * new and counted["paged"] == layers * new
    assert counted["dense"] == 0
    assert cache.get_seq_length() == L + new - 1
    kv = cache.layers[0].kv
    assert isinstance(kv.cache, PagedKVCache)
    valid = am.sum(1).numpy() + new - 1
    np.testing.assert_array_equal(kv.positions, valid)
    if kind.startswith("mistral"):
        w = model.config.sliding_window
        assert kv.cache.window == w
        assert (kv.lengths <= np.maximum(valid, w - 1 + 64)).all()
        if long:  # the window moved past block 0 of the long rows: released
            assert (kv.lengths < valid)[:2].all()
    else:
        np.testing.assert_array_equal(kv.lengths, valid)
    print(f"paged {kind}: max|Δ logits| = {diff:.2e}")


def test_default_blocks_give_the_64_row_tokens(rng):
    """The default pool (256-row blocks, 16 per chunk) generates what 64-row blocks do."""
    model = make("llama")
    ids, am = left_padded(2, 70, [0, 9], rng)
    out = []
    for cache in (
        af_cache.AttnFastPagedCache(model.config),
        af_cache.AttnFastPagedCache(model.config, block_size=64),
    ):
        got, logits = generate(model, "attn_fast", ids, am, 8, cache=cache, do_sample=False)
        out.append((got, logits, cache.layers[0].kv.cache))
    assert (out[0][2].block_size, out[0][2].num_blocks) == (256, 16)
    assert out[1][2].block_size == 64
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "int8", "float8_e4m3", "float8_e5m2"])
def test_reduced_precision_storage(storage, counted, rng):
    model = make("llama")
    ids, am = left_padded(2, 12, [0, 4], rng)
    new = 10
    ref_ids, ref_logits = generate(model, "sdpa", ids, am, new, do_sample=False)
    cache = af_cache.AttnFastPagedCache(model.config, dtype=storage, block_size=64)
    got_ids, got_logits = generate(model, "attn_fast", ids, am, new, cache=cache, do_sample=False)
    pool = cache.layers[0].kv.cache
    assert pool.dtype == PagedKVCache(1, 1, dtype=storage, block_size=64).dtype
    assert cache.nbytes == sum(layer.kv.cache.nbytes for layer in cache.layers)
    diff, steps = compared_diff(ref_ids, ref_logits, got_ids, got_logits, 12)
    assert diff <= TOL.get(storage, 0.25), (storage, diff, steps)
    assert counted["dense"] == 0 and counted["paged"] == 2 * new
    agree = float((got_ids[:, 12:] == ref_ids[:, 12:]).float().mean())
    print(f"paged {storage}: max|Δ logits| = {diff:.2e} over {steps} steps, agreement {agree:.0%}")


def test_bfloat16_model_stores_its_dtype(rng):
    """dtype=None: a bfloat16 model's pages are bfloat16; logits as the contiguous cache's."""
    model = make("llama", dtype=torch.bfloat16)
    ids, am = left_padded(2, 12, [0, 4], rng)
    flat = af_hf.AttnFastCache(model.config)
    ref_ids, ref_logits = generate(model, "attn_fast", ids, am, 8, cache=flat, do_sample=False)
    cache = af_cache.AttnFastPagedCache(model.config, block_size=64)
    got_ids, got_logits = generate(model, "attn_fast", ids, am, 8, cache=cache, do_sample=False)
    assert cache.layers[0].kv.dtype == PagedKVCache(1, 1, dtype="bfloat16", block_size=64).dtype
    diff, steps = compared_diff(ref_ids, ref_logits, got_ids, got_logits, 12)
    assert diff <= TOL_BF16_MODEL, (diff, steps)


def test_int8_token_agreement_with_float32(rng):
    """Greedy generation with int8 pages vs float32 pages, over a few prompts: the fraction
    of generated tokens equal to the float32 run (printed; loosely bounded)."""
    model = make("llama")
    agree, total = 0, 0
    for _ in range(3):
        ids, am = left_padded(4, 16, [0, 3, 7, 11], rng)
        runs = []
        for storage in ("float32", "int8"):
            cache = af_cache.AttnFastPagedCache(model.config, dtype=storage, block_size=64)
            runs.append(generate(model, "attn_fast", ids, am, 24, cache=cache, do_sample=False))
        (f_ids, _), (q_ids, _) = runs
        agree += int((q_ids[:, 16:] == f_ids[:, 16:]).sum())
        total += q_ids[:, 16:].numel()
    frac = agree / total
    print(f"int8 pages vs float32 pages: {agree}/{total} tokens equal ({frac:.1%})")
    assert frac >= 0.5


@pytest.mark.parametrize("storage", [None, "int8"])
@pytest.mark.parametrize("kind", ["llama", "mistral_window"])
def test_beam_search_forks(kind, storage, rng):
    """num_beams > 1: reorder_cache forks the kept sequences (copy-on-write) and frees the
    rest, for every storage type; float32 gives sdpa's beams; the pool does not leak."""
    model = make(kind)
    ids, am = left_padded(2, 7, [0, 2], rng)
    kw = dict(do_sample=False, num_beams=3, max_new_tokens=9)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model.generate(input_ids=ids, attention_mask=am, **kw)
        model.set_attn_implementation("attn_fast")
        cache = af_cache.AttnFastPagedCache(model.config, dtype=storage, block_size=64)
        got = model.generate(input_ids=ids, attention_mask=am, cache=cache, **kw)
    if storage is None:
        assert torch.equal(got, ref)
    else:
        assert got.shape == ref.shape
    for layer in cache.layers:
        pool, live = layer.kv.cache, layer.kv.ids
        assert pool.seq_ids == live and len(live) == 2 * 3
        held = {int(g) for i in live for g in pool.block_table(i)[0][: -(-pool.lengths[i] // 64)]}
        assert pool.num_blocks - pool.free_blocks == len(held)  # freed beams' blocks returned


def test_reorder_crop_and_reset():
    model = make("llama")
    model.set_attn_implementation("attn_fast")
    ids, am = left_padded(3, 8, [0, 2, 5])
    cache = af_cache.AttnFastPagedCache(model.config, block_size=64)
    _step(model, ids, cache, am)
    kv = cache.layers[0].kv
    np.testing.assert_array_equal(kv.lengths, [8, 6, 3])
    before = [np.array(kv.cache.keys(i)) for i in kv.ids]
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    np.testing.assert_array_equal(kv.lengths, [3, 8, 8])
    for b, src in enumerate(idx.tolist()):
        np.testing.assert_array_equal(np.array(kv.cache.keys(kv.ids[b])), before[src])
    # the next step on the reordered cache equals one on a cache of the reordered prompts
    tok = torch.tensor([[5], [6], [7]])
    am2 = torch.cat([am[idx], torch.ones(3, 1, dtype=am.dtype)], 1)
    got = _step(model, tok, cache, am2)
    fresh = af_cache.AttnFastPagedCache(model.config, block_size=64)
    _step(model, ids[idx], fresh, am[idx])
    torch.testing.assert_close(got, _step(model, tok, fresh, am2), rtol=0, atol=1e-6)
    # crop: drop the last token and feed it again -> the same logits
    cache.crop(-1)
    assert cache.get_seq_length() == 8
    np.testing.assert_array_equal(kv.lengths, [3, 8, 8])
    torch.testing.assert_close(_step(model, tok, cache, am2), got, rtol=0, atol=1e-6)
    cache.batch_repeat_interleave(2)
    assert kv.lengths.tolist() == [4, 4, 9, 9, 9, 9]
    with pytest.raises(IndexError, match="out of range"):
        cache.batch_select_indices(torch.tensor([6]))
    cache.reset()
    assert cache.get_seq_length() == 0 and kv.lengths.tolist() == [0] * 6
    assert kv.cache.free_blocks == kv.cache.num_blocks


def test_assisted_generation_crops(rng):
    model, draft = make("llama"), make("qwen2")
    ids, am = left_padded(1, 9, [0], rng)
    ref_ids, _ = generate(model, "sdpa", ids, am, 10, do_sample=False)
    model.set_attn_implementation("attn_fast")
    cache = af_cache.AttnFastPagedCache(model.config, block_size=64)
    with torch.no_grad():
        got = model.generate(
            input_ids=ids,
            attention_mask=am,
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            cache=cache,
            assistant_model=draft,
        )
    assert torch.equal(got, ref_ids)
    assert cache.get_seq_length() == 9 + 10 - 1


def test_bad_construction_and_misuse():
    config = make("llama").config
    with pytest.raises(TypeError, match="model's config"):
        af_cache.AttnFastPagedCache(None)
    with pytest.raises(TypeError, match="dtype"):
        af_cache.AttnFastPagedCache(config, dtype="complex64")
    with pytest.raises(ValueError, match="block_size must be a multiple of 64"):
        af_cache.AttnFastPagedCache(config, block_size=32)
    with pytest.raises(ValueError, match="num_blocks"):
        af_cache.AttnFastPagedCache(config, num_blocks=0)
    model = make("llama")
    ids, am = left_padded(1, 5, [0])
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_fast attention implementation only"):
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=am,
                cache=af_cache.AttnFastPagedCache(config, block_size=64),
            )
    model.set_attn_implementation("attn_fast")
    cache = af_cache.AttnFastPagedCache(model.config, block_size=64)
    with pytest.raises(ValueError, match="left padding only"):
        with torch.no_grad():
            am_r = torch.tensor([[1, 1, 1, 1, 0]])
            model(input_ids=ids, attention_mask=am_r, cache=cache)
