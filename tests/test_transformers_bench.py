"""bench/benchmarks/bench_hf.py and bench/accuracy/token_agreement.py: they run, and what they
check holds.

Tiny shapes, one repeat: the figures mean nothing and no timing is asserted;
the tests check the scripts' own correctness logic (tokens compared with the
reference, the reduced-precision cache adapter equal to a real KVCache).
"""

from __future__ import annotations

import importlib.util
import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from attn_fast import KVCache  # noqa: E402

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")


def _load(folder, name):
    path = os.path.join(BENCH, folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ta = _load("accuracy", "token_agreement")
bh = _load("benchmarks", "bench_hf")


@pytest.mark.parametrize("storage", ["bfloat16", "float16"])
def test_casting_adapter_equals_a_storage_cache(storage, rng):
    """The tiny LM's adapter: float32 in, the real 16-bit KVCache inside, float32 out."""
    B, H, Hq, d, L = 2, 2, 4, 80, 7
    k, v = (rng.standard_normal((B, H, L, d)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((B, Hq, L, d)).astype(np.float32)
    ad = ta.CastingKVCache(B, H, d, 16, storage)
    ad.append(k, v)
    got = ad.attend(q)
    assert got.dtype == np.float32 and got.shape == (B, Hq, L, d)
    ref_cache = KVCache(B, H, d, capacity=16, dtype=storage)
    tdt = getattr(torch, storage)
    tk, tv, tq = (torch.from_numpy(x).to(tdt) for x in (k, v, q))  # torch's rounding
    ref_cache.append(tk, tv)
    ref = ref_cache.attend(tq).float().numpy()
    np.testing.assert_array_equal(got, ref)
    assert ad.lengths.tolist() == [L, L] and ad.nbytes == ref_cache.nbytes
    ad.truncate(3)
    assert ad.positions.tolist() == [3, 3]


def test_token_agreement_float32_is_exact(monkeypatch):
    monkeypatch.setattr(ta, "TINY", dict(ta.TINY, vocab_size=300, d_model=64, num_layers=2))
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    monkeypatch.setattr(ta, "HF", dict(ta.HF, **small))
    out = io.StringIO()
    rows = ta.run(["tiny", "hf"], ["float32", "bfloat16"], prompts=2, prompt_len=5, new=3, out=out)
    f32 = [r for r in rows if r["dtype"] == "float32"]
    assert len(f32) == 2 and all(r["agree"] == 1.0 and r["dlogits0"] == 0.0 for r in f32), rows
    bf = [r for r in rows if r["dtype"] == "bfloat16"]
    assert all(0 < r["dlogits0"] < 0.1 and 0 <= r["agree"] <= 1 for r in bf), rows
    assert "tokens equal" in out.getvalue()


def test_agreement_helper():
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
    got = np.array([[1, 2, 3, 4], [1, 9, 3, 4]])
    assert ta.agreement(ref, got) == (7 / 8, (4 + 1) / 2)


def test_bench_hf_runs_and_compares_tokens(monkeypatch):
    def small(dtype=torch.float32):
        cfg = transformers.LlamaConfig(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).to(dtype).eval()

    monkeypatch.setattr(bh, "build_model", small)
    monkeypatch.setattr(bh, "QUICK_CASES", [("prefill padded", 2, 24, 0.25)])
    monkeypatch.setattr(bh, "QUICK_PROMPT", 16)
    out = io.StringIO()
    rows = bh.run(repeats=1, decode_tokens=3, quick=True, out=out)
    gen = [r for r in rows if r["case"].startswith("generate")]
    assert {r["impl"] for r in gen} == {"attn_fast", "attn_fast+cache"}
    assert all(r["same_tokens"] for r in gen), rows  # float32: the same tokens as sdpa
    assert "decode ms/step" in out.getvalue()
