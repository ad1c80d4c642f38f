"""Run a Hugging Face transformers model with attn_fast on the CPU.

    pip install '.[transformers]'
    python examples/hf_transformers.py                       # tiny random Llama, no download
    python examples/hf_transformers.py --model PATH_OR_NAME  # any local/Hub causal LM checkpoint

One call, ``register()``, makes ``attn_implementation="attn_fast"`` available;
the model then runs every attention layer through attn_fast (padding, causal
prefill, KV-cache decode, GQA, sliding windows). The script checks the logits
against transformers' own "sdpa" implementation and generates greedily with both.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import attn_fast.integrations.transformers as af_hf


def small_random_model():
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint for AutoModelForCausalLM (default: small random model)",
    )
    p.add_argument("--new-tokens", type=int, default=20)
    args = p.parse_args()

    af_hf.register()  # adds "attn_fast" to transformers' AttentionInterface and mask interface

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.model, attn_implementation="attn_fast", dtype=torch.float32
        )
    else:
        model = small_random_model()
        model.set_attn_implementation("attn_fast")
    model.eval()

    # A left-padded batch of two prompts (as a tokenizer with padding_side="left" would give).
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :16] = 0

    with torch.no_grad():
        logits = {}
        for impl in ("sdpa", "attn_fast"):
            model.set_attn_implementation(impl)
            model(input_ids=ids, attention_mask=mask)  # warm-up
            t0 = time.perf_counter()
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits
            print(f"{impl:>9}: forward {1e3 * (time.perf_counter() - t0):7.1f} ms")
        diff = (logits["attn_fast"] - logits["sdpa"])[mask.bool()].abs().max().item()
        print(f"max |logits(attn_fast) - logits(sdpa)| over non-padding tokens: {diff:.2e}")

        out = {}
        for impl in ("sdpa", "attn_fast"):
            model.set_attn_implementation(impl)
            out[impl] = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False
            )
        print("greedy tokens identical:", torch.equal(out["sdpa"], out["attn_fast"]))
        print("attn_fast continuation of prompt 0:", out["attn_fast"][0, ids.shape[1] :].tolist())


if __name__ == "__main__":
    main()
