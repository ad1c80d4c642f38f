"""Greedy token agreement: a reduced-precision KV cache against the float32 cache.

    python bench/accuracy/token_agreement.py               # bfloat16 and float16 caches,
                                                           # both models
    python bench/accuracy/token_agreement.py --dtype int8  # any storage dtype KVCache accepts
    python bench/accuracy/token_agreement.py --models hf --prompts 16 --new 64

For each model, B prompts of random tokens generate N tokens greedily twice:
with a float32 KV cache (the reference) and with a cache stored in --dtype.
Everything else is the same float32 model; the difference is the cache's
storage (keys and values rounded/quantised as they are stored) and the
queries, which the cache takes in its own dtype (rounded to it before
attention; accumulation and softmax stay float32). Reported per model and
dtype: the fraction of generated tokens equal to the reference at the same
position, the mean number of steps before a sequence's first difference,
and max |Δ logits| of the first generated token (the prompt's last position:
the prefill and the cache write, before any divergence).

Models (random weights, no download):
- tiny: ``attn_fast.TinyTransformerLM`` (4 layers, D 256, 8 heads / 2 kv heads,
  d 32, vocab 4096), its ``LayerCaches`` replaced by casting adapters around
  real KVCache objects of --dtype (``CastingKVCache`` below: the model is
  float32 only, the adapter casts each chunk and query on the way in and the
  output back to float32);
- hf: a transformers Llama (4 layers, hidden 512, 8 heads / 2 kv heads, d 64,
  vocab 1000) with attn_implementation="attn_fast" and
  ``AttnFastCache(config, dtype=...)``.

Random-weight models have flat logits (small top-1/top-2 gaps), so they
diverge sooner than trained ones: read the figures as a pessimistic bound
for these shapes, not as a trained model's agreement.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import attn_fast as af
from attn_fast import KVCache
from attn_fast._checks import BF16, F16, bf16_bits

_FLOAT_STORAGE = (np.dtype(np.float32), np.dtype(np.float64), F16, BF16)


class CastingKVCache(KVCache):
    """A float32-facing adapter around a real KVCache of another storage dtype (``inner``).

    The tiny LM's layers take caches of their own dtype only; this one passes
    their checks as a float32 KVCache, and its append/attend cast each chunk
    and query to the storage dtype (bfloat16: round to nearest even on the
    bits, no ml_dtypes needed), run the inner cache, and widen the output
    back to float32. Storage dtypes that are not float (int8) get float32.
    """

    def __init__(self, batch, num_kv_heads, head_dim, capacity, storage):
        super().__init__(batch, num_kv_heads, head_dim, capacity=1, dtype=np.float32)
        self.inner = KVCache(batch, num_kv_heads, head_dim, capacity=capacity, dtype=storage)

    def _to_storage(self, x):
        dt = self.inner.dtype
        if dt == BF16:  # round to nearest even, as a bfloat16 cast does
            b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
            return bf16_bits(r)
        if dt in _FLOAT_STORAGE:
            return np.asarray(x).astype(dt)
        return np.asarray(x, dtype=np.float32)  # int8 & co. quantise float32 chunks themselves

    def append(self, k, v, lengths=None, rope=None):
        self.inner.append(self._to_storage(k), self._to_storage(v), lengths=lengths, rope=rope)

    def attend(self, q, scale=None, causal=True, **kw):
        o = self.inner.attend(self._to_storage(q), scale=scale, causal=causal, **kw)
        o = np.asarray(o)
        if self.inner.dtype == BF16:
            o = (o.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return o.astype(np.float32)

    lengths = property(lambda self: self.inner.lengths)
    positions = property(lambda self: self.inner.positions)
    capacity = property(lambda self: self.inner.capacity)
    nbytes = property(lambda self: self.inner.nbytes)

    def reset(self):
        self.inner.reset()

    def truncate(self, n):
        self.inner.truncate(n)


def tiny_generate(lm, prompt, new, storage):
    """Greedy tokens (B, new) and the first step's logits (B, V) with a cache of `storage`."""
    B, Lp = prompt.shape
    if storage == "float32":
        cache = lm.make_cache(B, Lp + new)
    else:  # the model indexes and iterates its caches: a list of adapters will do
        cache = [
            CastingKVCache(B, lm.num_kv_heads, lm.head_dim, Lp + new, storage)
            for _ in range(lm.num_layers)
        ]
    logits = lm.forward(prompt, cache=cache)[:, -1]
    first = logits.copy()
    toks = []
    for step in range(new):
        nxt = np.argmax(logits, axis=-1)
        toks.append(nxt)
        if step < new - 1:
            logits = lm.forward(nxt[:, None], cache=cache)[:, -1]
    return np.stack(toks, axis=1), first


def hf_generate(model, prompt, new, storage):
    import torch

    import attn_fast.integrations.transformers as af_hf

    ids = torch.from_numpy(prompt)
    cache = af_hf.AttnFastCache(model.config, dtype=storage)
    with torch.no_grad():
        g = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return g.sequences[:, prompt.shape[1] :].numpy(), g.logits[0].float().numpy()


# The two models: TinyTransformerLM(vocab, d_model, layers, heads, kv_heads) and a LlamaConfig.
TINY = dict(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=2)
HF = dict(
    vocab_size=1000,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    pad_token_id=0,
)


def build(name, seed=0):
    if name == "tiny":
        lm = af.TinyTransformerLM(**TINY, seed=seed)
        return lm, TINY["vocab_size"], tiny_generate
    import torch
    import transformers

    import attn_fast.integrations.transformers as af_hf

    af_hf.register()
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF)).eval()
    model.set_attn_implementation("attn_fast")
    return model, HF["vocab_size"], hf_generate


def agreement(ref, got):
    """(fraction of equal tokens, mean steps before the first difference per sequence)."""
    eq = ref == got
    first = np.where(eq.all(axis=1), eq.shape[1], np.argmin(eq, axis=1))
    return float(eq.mean()), float(first.mean())


def run(models, dtypes, prompts, prompt_len, new, out=sys.stdout):
    c = af._config.config()
    print(
        f"attn_fast {c['version']}  ISA {c['isa']}  threads {c['num_threads']}  CPU {c['cpu']}",
        file=out,
    )
    print(
        f"greedy, {prompts} random prompts of {prompt_len} tokens, {new} new tokens; "
        "reference: the float32 cache",
        file=out,
    )
    hdr = f"{'model':<6} {'cache':<9} | {'tokens equal':>12} {'steps to 1st diff':>17} | "
    hdr += f"{'max|Δ logits| step 0':>21} {'|logits| max':>12}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rows = []
    for name in models:
        model, vocab, gen = build(name)
        rng = np.random.default_rng(1)
        prompt = rng.integers(1, vocab, size=(prompts, prompt_len)).astype(np.int64)
        ref, ref_first = gen(model, prompt, new, "float32")
        for dt in dtypes:
            got, first = gen(model, prompt, new, dt)
            frac, steps = agreement(ref, got)
            d0 = float(np.abs(first - ref_first).max())
            rows.append(dict(model=name, dtype=dt, agree=frac, steps=steps, dlogits0=d0))
            print(
                f"{name:<6} {dt:<9} | {frac:12.1%} {steps:11.1f} / {new:<4} | {d0:21.2e} "
                f"{float(np.abs(ref_first).max()):12.2f}",
                file=out,
                flush=True,
            )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dtype",
        nargs="+",
        default=["bfloat16", "float16"],
        help="cache storage dtypes to compare with float32 (anything KVCache(dtype=) accepts)",
    )
    p.add_argument("--models", nargs="+", choices=("tiny", "hf"), default=["tiny", "hf"])
    p.add_argument("--prompts", type=int, default=8, help="sequences (one batch)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=32, help="greedy tokens per sequence")
    p.add_argument("--threads", type=int, default=0, help="kernel threads (0 = leave as is)")
    args = p.parse_args(argv)
    if args.threads:
        af.set_num_threads(args.threads)
    run(args.models, args.dtype, args.prompts, args.prompt_len, args.new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
