"""Memory a CurKVCache holds after a prefill, against a DynamicCache of the same prompt, per allocation and keep ratio.

Usage: python benchmarks/bench_cache_bytes.py [--base embedded:smollm2-135m-instruct] [--scorer smollm2-135m]
       [--contexts 1024,4096] [--keeps 0.3,0.5,0.7] [--allocations per_head,joint]

For each context and keep ratio a prompt of stdlib source is prefilled into a DynamicCache and into CurKVCache
(``layer_budget="uniform"``: the joint allocation refuses a per-layer split, so both rows get one ratio). It prints
the bytes ``nbytes()`` counts and the K/V bytes of the tokens held (from each head's held count, plus a hybrid
model's sliding-window layers from their tensors) as shares of the DynamicCache's K/V bytes, the compressed layers'
K/V alone as a share of theirs in the DynamicCache, and the least and most tokens a compressed (layer, KV head)
holds. One JSON line per row follows. A scorer for another base needs its ``--base`` (``embedded:gemma3-270m``).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import DynamicCache

from curkv_train.models.base import load_base_model, load_tokenizer
from curkv_train.runtime import CurKVCache, TierConfig
from bench_decode import held_bytes, stdlib_prompt  # beside this script
from bench_scoring_cost import make_scorer


def held_per_head(cache: CurKVCache) -> torch.Tensor:
    """(layers, batch, kv_heads) tokens each compressed (layer, KV head) holds (a dense layer: one count for all)."""
    return torch.stack([layer.held_lengths() if hasattr(layer, "held_lengths")
                        else torch.full(tuple(layer.keys.shape[:2]), layer.held_tokens)
                        for layer in cache.compressed_layers])


@torch.no_grad()
def measure(model, scorer, ids: torch.Tensor, keep: float, allocation: str) -> dict:
    """One prefill of ``ids`` (1, tokens) through each cache: the shares described in the module docstring."""
    plain = DynamicCache(config=model.config)
    model(ids, past_key_values=plain, logits_to_keep=1)
    cache = CurKVCache(scorer, model, keep_ratio=keep, layer_budget="uniform", tiers=TierConfig(allocation=allocation))
    model(ids, past_key_values=cache, logits_to_keep=1)
    full = held_bytes(plain)
    counts = held_per_head(cache)
    first = plain.layers[0].keys
    compressed = [layer.layer_idx for layer in cache.compressed_layers]
    kv = int(counts.sum()) * 2 * first.shape[-1] * first.element_size()
    # a hybrid model's sliding-window layers, held as transformers holds them: counted from their tensors
    sliding = sum(layer.keys.nbytes + layer.values.nbytes for index, layer in enumerate(cache.layers)
                  if index not in compressed)
    full_compressed = sum(plain.layers[index].keys.nbytes + plain.layers[index].values.nbytes for index in compressed)
    row = {"context": ids.shape[-1], "keep": keep, "allocation": allocation, "full_kv_bytes": full,
           "nbytes_share": round(cache.nbytes() / full, 4), "kv_share": round((kv + sliding) / full, 4),
           "compressed_kv_share": round(kv / full_compressed, 4),
           "least_per_head": int(counts.min()), "most_per_head": int(counts.max())}
    cache.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--scorer", default="smollm2-135m", help="a scorer folder or shipped name, or init:FAMILY")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--keeps", default="0.3,0.5,0.7")
    parser.add_argument("--allocations", default="per_head,joint")
    args = parser.parse_args()
    model = load_base_model(args.base, attn_implementation="sdpa")
    tokenizer = load_tokenizer(args.base)
    scorer = make_scorer(args.scorer, model)
    rows = []
    print(f"{'context':>8} {'keep':>5} {'allocation':>10} {'nbytes/full':>12} {'K/V/full':>9} {'compressed':>11} "
          f"{'per head':>12}")
    for context in map(int, args.contexts.split(",")):
        ids = stdlib_prompt(tokenizer, context)
        for keep in map(float, args.keeps.split(",")):
            for allocation in args.allocations.split(","):
                row = measure(model, scorer, ids, keep, allocation)
                rows.append(row)
                print(f"{context:>8} {keep:>5} {allocation:>10} {row['nbytes_share']:>12.4f} {row['kv_share']:>9.4f} "
                      f"{row['compressed_kv_share']:>11.4f} "
                      f"{row['least_per_head']:>5}-{row['most_per_head']:<6}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
