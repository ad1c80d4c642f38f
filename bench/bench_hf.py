"""End-to-end forward time of a small transformers model: "sdpa" vs "attn_fast".

    python bench/bench_hf.py                 # default cases, all threads
    python bench/bench_hf.py --threads 1 --repeats 3
    python bench/bench_hf.py --dtype bf16    # the model in bfloat16 (or fp16), both columns
    python bench/bench_hf.py --quick         # shorter cases (L = 256, a 128-token prompt)

The model is a Llama-style decoder built from a random config (no download):
hidden 512, 8 query heads and 2 key/value heads of dim 64 (GQA), 4 layers,
float32. Each case first checks that the two implementations agree (max
|Δ logits| over the non-padding positions, printed), then times full forward
passes under torch.no_grad(), interleaving the two implementations; times are
medians (the correctness check doubles as the warm-up). Everything but
attention (embeddings, projections, MLPs, RoPE, norms,
mask building) is the same torch code in both columns, so the ratio is the
end-to-end effect a user sees, not the attention kernel alone.

Cases: causal prefill of one sequence (sdpa dispatches to torch's flash kernel
with is_causal), a left-padded batch (sdpa receives a dense boolean mask;
attn_fast gets the causal flag and a per-key padding mask), and greedy decode
(one token per step against transformers' DynamicCache).

``--dtype bf16`` / ``fp16``: the model's weights and activations in that dtype
for both implementations; attn_fast then computes attention on the 16-bit
tensors themselves (no upcast copy, float32 accumulation), sdpa with torch's
own 16-bit kernels. The agreement check allows the model's 16-bit rounding
(max |Δ logits| < 0.5, printed), and the generate row says whether the greedy
tokens are identical (or the fraction that agree).
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


def run(repeats=5, threads=None, decode_tokens=32, out=sys.stdout, dtype="fp32", quick=False):
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
        f"model: Llama-style, hidden 512, 4 layers, 8 q heads / 2 kv heads, d 64, {dtype}, random "
        "weights",
        file=out,
    )
    hdr = (
        f"{'case':<16} {'B':>2} {'L':>5} | {'sdpa ms':>9} {'attn_fast ms':>12} {'speed-up':>8} | "
        f"{'max|Δ logits|':>13}"
    )
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    rows = []
    for name, B, L, pad in QUICK_CASES if quick else CASES:
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
            f"{ms['sdpa'] / ms['attn_fast']:7.2f}x "
            f"| {err:13.2e}",
            file=out,
            flush=True,
        )
    if decode_tokens:
        P = 128 if quick else 512  # prompt length
        ids, am = inputs(1, P, 0.0)
        per_tok = {}
        toks = {}
        for impl in ("sdpa", "attn_fast"):
            model.set_attn_implementation(impl)
            kw = dict(max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
            with torch.no_grad():
                model.generate(
                    input_ids=ids, attention_mask=am, max_new_tokens=2, do_sample=False
                )  # warm-up
                t0 = time.perf_counter()
                toks[impl] = model.generate(input_ids=ids, attention_mask=am, **kw)
                per_tok[impl] = 1e3 * (time.perf_counter() - t0) / decode_tokens
        same = torch.equal(toks["sdpa"], toks["attn_fast"])
        agree = (
            float((toks["sdpa"][:, P:] == toks["attn_fast"][:, P:]).float().mean())
            if not same
            else 1.0
        )
        verdict = "identical" if same else f"{agree:.0%} agree" if dtype != "fp32" else "DIFFER"
        print(
            f"{'generate/token':<16} {1:>2} {P:>5} | {per_tok['sdpa']:9.1f} "
            f"{per_tok['attn_fast']:12.1f} "
            f"{per_tok['sdpa'] / per_tok['attn_fast']:7.2f}x | tokens {verdict}",
            file=out,
            flush=True,
        )
        rows.append(
            dict(
                case="generate/token",
                dtype=dtype,
                B=1,
                L=P,
                sdpa_ms=per_tok["sdpa"],
                attn_fast_ms=per_tok["attn_fast"],
                same_tokens=same,
                token_agreement=agree,
            )
        )
    print(
        "speed-up = sdpa time / attn_fast time (higher means attn_fast is faster); "
        f"generate rows: ms per token incl. prefill of the prompt; {dtype}",
        file=out,
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
        "--decode-tokens",
        type=int,
        default=32,
        help="greedy tokens for the generate row (0 = skip)",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPES), default="fp32", help="the model's dtype (both columns)"
    )
    p.add_argument(
        "--quick", action="store_true", help="shorter cases: L = 256 and a 128-token prompt"
    )
    args = p.parse_args(argv)
    run(
        repeats=args.repeats,
        threads=args.threads,
        decode_tokens=args.decode_tokens,
        dtype=args.dtype,
        quick=args.quick,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
