"""End-to-end forward time of a small transformers model: "sdpa" vs "attn_fast".

    python bench/benchmarks/bench_hf.py               # default cases, all threads
    python bench/benchmarks/bench_hf.py --threads 1 --repeats 3
    python bench/benchmarks/bench_hf.py --dtype bf16  # the model in bf16 (or fp16), both columns
    python bench/benchmarks/bench_hf.py --quick       # shorter cases (L = 256, a 128-token prompt)

The model is a Llama-style decoder built from a random config (no download):
hidden 512, 8 query heads and 2 key/value heads of dim 64 (GQA), 4 layers,
float32. Each case first checks that the two implementations agree (max
|Δ logits| over the non-padding positions, printed), then times full forward
passes under torch.no_grad(), interleaving the two implementations; times are
medians (the correctness check doubles as the warm-up). Everything but
attention (embeddings, projections, MLPs, RoPE, norms, mask building) is the
same torch code in both columns, so the ratio is the end-to-end effect a user
sees, not the attention kernel alone.

Cases: causal prefill of one sequence (sdpa dispatches to torch's flash kernel
with is_causal), a left-padded batch (sdpa receives a dense boolean mask;
attn_fast gets the causal flag and a per-key padding mask), and greedy
``generate`` of one sequence and of a left-padded batch of 4, in ms per new
token (prefill of the prompt included; median of up to 3 interleaved runs)
for three columns: "sdpa" and "attn_fast" with transformers' DynamicCache,
and "+cache": attn_fast with ``AttnFastCache`` (K/V in attn_fast.KVCache in
the model's dtype, the decode kernel reading each sequence's valid keys in
place). The last column says whether the tokens equal sdpa's.

``--dtype bf16`` / ``fp16``: the model's weights and activations in that dtype
for both implementations; attn_fast then computes attention on the 16-bit
tensors themselves (no upcast copy, float32 accumulation), sdpa with torch's
own 16-bit kernels. The agreement check allows the model's 16-bit rounding
(max |Δ logits| < 0.5, printed), and the generate row says whether the greedy
tokens are identical (or the fraction that agree). ``--dtype fp32 bf16`` runs
both in one process, one table after the other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import transformers

import attn_fast as af
import attn_fast.integrations.transformers as af_hf

CASES = [
    # name, batch, length, left padding of the other rows (fraction of L)
    ("prefill", 1, 512, 0.0),
    ("prefill", 1, 2048, 0.0),
    ("prefill padded", 4, 512, 0.25),
]
QUICK_CASES = [("prefill", 1, 256, 0.0), ("prefill padded", 2, 256, 0.25)]
QUICK_PROMPT = 128  # the generate rows' prompt with --quick
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(dtype=torch.float32):
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def inputs(B, L, pad_frac, vocab=1000):
    g = torch.Generator().manual_seed(L * 31 + B)
    ids = torch.randint(1, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    for b in range(1, B):  # row 0 unpadded, the others left-padded by up to pad_frac of L
        am[b, : int(pad_frac * L * b / max(1, B - 1))] = 0
    return ids, am


def forward(model, impl, ids, am):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=am).logits


def run(
    repeats=5,
    threads=None,
    decode_tokens=32,
    out=sys.stdout,
    dtype="fp32",
    quick=False,
    prompt=None,
    forward_rows=True,
):
    """Print (and return as dicts) the forward rows and the generate rows for one dtype.

    prompt: the generate rows' prompt length (default 512, QUICK_PROMPT with
    quick); forward_rows=False skips the prefill rows.
    """
    af_hf.register()
    if threads:
        af.set_num_threads(threads)
    nt = af.get_num_threads()
    torch.set_num_threads(nt)
    cfg = af._config.config()
    print(
        f"attn_fast {cfg['version']}  ISA {cfg['isa']}  threads {nt}  CPU {cfg['cpu']}  "
        f"torch {torch.__version__}  transformers {transformers.__version__}",
        file=out,
    )
    model = build_model(DTYPES[dtype])
    tol = (
        1e-3 if dtype == "fp32" else 0.5
    )  # 16-bit: the rounding of the whole model, not attention's
    print(
        "model: Llama-style, hidden 512, 4 layers, 8 q heads / 2 kv heads, d 64, "
        f"{dtype}, random weights",
        file=out,
    )
    hdr = (
        f"{'case':<16} {'B':>2} {'L':>5} | {'sdpa ms':>9} {'attn_fast ms':>12} {'speed-up':>8} "
        f"| {'max|Δ logits|':>13}"
    )
    if forward_rows:
        print(hdr, file=out)
        print("-" * len(hdr), file=out)
    rows = []
    for name, B, L, pad in (QUICK_CASES if quick else CASES) if forward_rows else ():
        ids, am = inputs(B, L, pad)
        ref, got = forward(model, "sdpa", ids, am), forward(model, "attn_fast", ids, am)
        valid = am.bool()
        err = float((got.float() - ref.float())[valid].abs().max())
        if not err < tol:
            raise RuntimeError(f"{name}: attn_fast differs from sdpa by {err:.2e}")
        t = {impl: [] for impl in ("sdpa", "attn_fast")}
        for _ in range(repeats):  # interleaved, so drifting machine load hits both columns alike
            for impl in t:
                t0 = time.perf_counter()
                forward(model, impl, ids, am)
                t[impl].append(1e3 * (time.perf_counter() - t0))
        ms = {impl: statistics.median(v) for impl, v in t.items()}
        rows.append(
            dict(
                case=name,
                dtype=dtype,
                B=B,
                L=L,
                sdpa_ms=ms["sdpa"],
                attn_fast_ms=ms["attn_fast"],
                max_abs_diff=err,
            )
        )
        print(
            f"{name:<16} {B:>2} {L:>5} | {ms['sdpa']:9.1f} {ms['attn_fast']:12.1f} "
            f"{ms['sdpa'] / ms['attn_fast']:7.2f}x | {err:13.2e}",
            file=out,
            flush=True,
        )
    if decode_tokens:
        P = prompt or (QUICK_PROMPT if quick else 512)
        rows += generate_rows(model, dtype, decode_tokens, P, min(repeats, 3), out)
    print(
        "speed-up = sdpa time / attn_fast time (higher means attn_fast is faster); "
        "generate: ms per new token incl. the prompt's prefill; decode: ms per one-token step "
        f"(median); +cache = attn_fast with AttnFastCache; {dtype}",
        file=out,
    )
    return rows


GENERATE_IMPLS = (
    # column, attention implementation, cache
    ("sdpa", "sdpa", None),
    ("attn_fast", "attn_fast", None),  # transformers' DynamicCache
    ("attn_fast+cache", "attn_fast", "attn_fast"),  # AttnFastCache, the model's dtype
)


def _new_cache(model, cache):
    """The cache a GENERATE_IMPLS column passes (None: transformers' default DynamicCache)."""
    from transformers import DynamicCache

    if cache is None:
        return DynamicCache(config=model.config)
    return af_hf.AttnFastCache(model.config)


def generate_rows(model, dtype, new, P, repeats, out):
    """Greedy decoding for each of GENERATE_IMPLS, two measurements per case.

    generate: ``model.generate`` of `new` tokens, ms per new token including
    the prompt's prefill (median of `repeats` interleaved runs after a
    warm-up on the prompt's last 32 tokens); its tokens are compared with sdpa's.
    decode: ms per one-token forward step against a cache that already holds
    the prompt (median over `new` steps, the three columns interleaved step by
    step), the part of generation the cache decides.
    """
    cases = [("generate", 1, P, 0.0), ("generate padded", 4, P, 0.25)]
    cols = [col for col, _, _ in GENERATE_IMPLS]
    hdr = (
        f"{'case':<16} {'B':>2} {'P':>5} | {'generate ms/token':^26} | "
        f"{'decode ms/step':^26} | {'decode speed-up':^15} | tokens vs sdpa"
    )
    sub = (
        f"{'':<16} {'':>2} {'':>5} | {'sdpa':>8} {'attn_fast':>9} {'+cache':>7} | "
        f"{'sdpa':>8} {'attn_fast':>9} {'+cache':>7} | {'attn_fast':>9} {'+cache':>5} |"
    )
    print(hdr, file=out)
    print(sub, file=out)
    print("-" * len(hdr), file=out)
    rows = []
    for name, B, P_, pad in cases:
        ids, am = inputs(B, P_, pad)
        gen_t = {col: [] for col in cols}
        toks = {}
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
        with torch.no_grad():
            for _col, impl, cache in GENERATE_IMPLS:  # warm-up
                model.set_attn_implementation(impl)
                c = _new_cache(model, cache)
                model.generate(
                    input_ids=ids[:, -32:], attention_mask=am[:, -32:], max_new_tokens=2, cache=c
                )
            for _ in range(repeats):  # interleaved, as the forward rows
                for col, impl, cache in GENERATE_IMPLS:
                    model.set_attn_implementation(impl)
                    c = _new_cache(model, cache)
                    t0 = time.perf_counter()
                    toks[col] = model.generate(input_ids=ids, attention_mask=am, cache=c, **kw)
                    gen_t[col].append(1e3 * (time.perf_counter() - t0) / new)
            # decode steps: prefill each column's cache, then one token per step, interleaved
            state = {}
            for col, impl, cache in GENERATE_IMPLS:
                model.set_attn_implementation(impl)
                c = _new_cache(model, cache)
                logits = model(input_ids=ids, attention_mask=am, cache=c, use_cache=True).logits
                state[col] = (c, logits[:, -1:].argmax(-1), am)
            dec_t = {col: [] for col in cols}
            for _ in range(new):
                for col, impl, _cache in GENERATE_IMPLS:
                    c, tok, a = state[col]
                    a = torch.cat([a, torch.ones(B, 1, dtype=a.dtype)], 1)
                    model.set_attn_implementation(impl)
                    t0 = time.perf_counter()
                    logits = model(input_ids=tok, attention_mask=a, cache=c, use_cache=True).logits
                    dec_t[col].append(1e3 * (time.perf_counter() - t0))
                    state[col] = (c, logits[:, -1:].argmax(-1), a)
        g = {col: statistics.median(v) for col, v in gen_t.items()}
        d = {col: statistics.median(v) for col, v in dec_t.items()}
        verdicts = []
        for col in cols[1:]:
            same = torch.equal(toks["sdpa"], toks[col])
            agree = float((toks["sdpa"][:, P_:] == toks[col][:, P_:]).float().mean())
            verdicts.append("identical" if same else f"{agree:.0%} agree")
            rows.append(
                dict(
                    case=name,
                    impl=col,
                    dtype=dtype,
                    B=B,
                    L=P_,
                    sdpa_ms=g["sdpa"],
                    attn_fast_ms=g[col],
                    sdpa_decode_ms=d["sdpa"],
                    attn_fast_decode_ms=d[col],
                    same_tokens=same,
                    token_agreement=agree,
                )
            )
        print(
            f"{name:<16} {B:>2} {P_:>5} | {g['sdpa']:8.1f} {g['attn_fast']:9.1f} "
            f"{g['attn_fast+cache']:7.1f} | {d['sdpa']:8.1f} {d['attn_fast']:9.1f} "
            f"{d['attn_fast+cache']:7.1f} | {d['sdpa'] / d['attn_fast']:8.2f}x "
            f"{d['sdpa'] / d['attn_fast+cache']:4.2f}x | {' / '.join(verdicts)}",
            file=out,
            flush=True,
        )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--threads", type=int, default=None, help="threads for attn_fast and torch (default: all)"
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--prompt",
        type=int,
        default=None,
        help="prompt length of the generate rows (default 512; 128 with --quick)",
    )
    p.add_argument("--no-forward", action="store_true", help="only the generate rows")
    p.add_argument(
        "--decode-tokens",
        type=int,
        default=32,
        help="greedy tokens for the generate row (0 = skip)",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        nargs="+",
        default=["fp32"],
        help="the model's dtype (every column); several: one table each, same run",
    )
    p.add_argument(
        "--quick", action="store_true", help="shorter cases: L = 256 and a 128-token prompt"
    )
    args = p.parse_args(argv)
    for dtype in args.dtype:
        run(
            repeats=args.repeats,
            threads=args.threads,
            decode_tokens=args.decode_tokens,
            dtype=dtype,
            quick=args.quick,
            prompt=args.prompt,
            forward_rows=not args.no_forward,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
