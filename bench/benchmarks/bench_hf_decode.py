"""Time per generated token through transformers after a long prompt: sdpa vs attn_fast.

    python bench/benchmarks/bench_hf_decode.py  # P 512 and 4096, fp32 + bf16
    python bench/benchmarks/bench_hf_decode.py --layers 30 --prompt 512 --batch 1 --dtype fp32
    python bench/benchmarks/bench_hf_decode.py --threads 2 --steps 32

The model is a Llama-style decoder built from a SmolLM2-135M-like config with
random weights (no download): hidden 576, 9 query heads and 3 key/value heads
of dim 64 (GQA), intermediate 1536, vocabulary 49152, tied embeddings;
``--layers`` of them (SmolLM2-135M has 30; fewer by default, to keep the
prefill of a 4096-token prompt short on 2 cores: the decode step's per-layer
cost is what differs between the columns).

For each dtype, batch (1, or B > 1 with rows left-padded by up to a quarter of
the prompt) and prompt length P, each column prefills its own cache with the
prompt (``logits_to_keep=1``), then runs ``--steps`` greedy one-token forward
steps, the three columns interleaved step by step (the order rotated at each
step, so that no column always runs after the same one) so that machine load
hits them alike. Columns: "sdpa" (transformers' DynamicCache), "attn_fast" (the
attn_fast backend with DynamicCache: K/V read in place from the cache's
tensors) and "+cache" (the attn_fast backend with ``AttnFastCache``). Reported:
the median ms per step, sdpa's time over each attn_fast column's (higher is
faster), and whether the greedy tokens equal sdpa's (fp32: they should; 16-bit:
the fraction that agree, as the two backends round differently). Everything but
attention (projections, MLP, RoPE, norms, mask building, the LM head) is the
same torch code in all columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_hf  # noqa: E402  (the sibling script: inputs, columns, caches)

import attn_fast as af  # noqa: E402
import attn_fast.integrations.transformers as af_hf  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(dtype, layers, max_pos):
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def decode_case(model, B, P, steps, clock=time.perf_counter):
    """{column: (median ms per step, greedy tokens (B, steps))} for one batch and prompt."""
    ids, am = bench_hf.inputs(B, P, 0.25 if B > 1 else 0.0, vocab=model.config.vocab_size)
    state, toks, times = {}, {}, {}
    with torch.no_grad():
        for col, impl, cache in bench_hf.GENERATE_IMPLS:
            model.set_attn_implementation(impl)
            c = bench_hf._new_cache(model, cache)
            logits = model(
                input_ids=ids, attention_mask=am, cache=c, use_cache=True, logits_to_keep=1
            ).logits
            tok = logits[:, -1:].argmax(-1)
            state[col], toks[col], times[col] = (c, tok, am), [tok], []
        cols = list(bench_hf.GENERATE_IMPLS)
        for s in range(steps):
            for col, impl, _cache in cols[s % len(cols) :] + cols[: s % len(cols)]:
                c, tok, a = state[col]
                a = torch.cat([a, torch.ones(B, 1, dtype=a.dtype)], 1)
                model.set_attn_implementation(impl)
                t0 = clock()
                logits = model(input_ids=tok, attention_mask=a, cache=c, use_cache=True).logits
                times[col].append(1e3 * (clock() - t0))
                tok = logits[:, -1:].argmax(-1)
                state[col] = (c, tok, a)
                toks[col].append(tok)
    return {col: (statistics.median(times[col]), torch.cat(toks[col], 1)) for col in times}


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--prompt", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtype", choices=tuple(DTYPES), nargs="+", default=["fp32", "bf16"])
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time per step (with --threads 1 the whole step runs on "
        "the calling thread, so a loaded machine does not inflate it)",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error("--clock cpu needs --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    af_hf.register()
    af.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    cfg = af._config.config()
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(
        f"attn_fast {cfg['version']} | ISA {cfg['isa']} | threads {args.threads} | "
        f"CPU {cfg['cpu']} | torch {torch.__version__} | transformers {transformers.__version__}"
        f" | {args.clock} clock | load {load}"
    )
    print(
        f"model: SmolLM2-135M-like (hidden 576, 9 q / 3 kv heads, d 64), {args.layers} layers, "
        f"random weights; {args.steps} greedy steps after the prompt, ms per step (median)"
    )
    hdr = (
        f"{'dtype':<5} {'B':>2} {'P':>5} | {'sdpa':>7} {'attn_fast':>9} {'+cache':>7} | "
        f"{'attn_fast':>9} {'+cache':>7} | tokens vs sdpa (attn_fast / +cache)"
    )
    print(hdr)
    print("-" * len(hdr))
    for dt in args.dtype:
        model = build_model(DTYPES[dt], args.layers, max(args.prompt) + args.steps + 8)
        for B in args.batch:
            for P in args.prompt:
                r = decode_case(model, B, P, args.steps, clock)
                ms = {c: v[0] for c, v in r.items()}
                verdicts = []
                for col in ("attn_fast", "attn_fast+cache"):
                    same = torch.equal(r["sdpa"][1], r[col][1])
                    agree = float((r["sdpa"][1] == r[col][1]).float().mean())
                    verdicts.append("identical" if same else f"{agree:.0%} agree")
                print(
                    f"{dt:<5} {B:>2} {P:>5} | {ms['sdpa']:7.2f} {ms['attn_fast']:9.2f} "
                    f"{ms['attn_fast+cache']:7.2f} | {ms['sdpa'] / ms['attn_fast']:8.2f}x "
                    f"{ms['sdpa'] / ms['attn_fast+cache']:6.2f}x | {' / '.join(verdicts)}",
                    flush=True,
                )
    print("speed-up = sdpa ms / attn_fast ms per step (higher: attn_fast faster)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
