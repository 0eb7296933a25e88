"""The joint allocation's first compression in a prefill: deferral against a threshold, on held-out prefills.

Usage: python benchmarks/bench_threshold_vs_deferral.py [--scorer smollm2-135m] [--keeps 0.5,0.3,0.15]
       [--examples 8] [--context 1024] [--continuation 128] [--calibration 4]

**Deferral** (what CurKVCache does): every layer holds the whole prompt until the last has run, then the best
competing tokens of all layers and KV heads fill exactly the budget's places. Its peak is a full cache.
**Threshold** (KVzap's way with kvpress's DMSPress): a layer compresses as soon as it has run. It keeps the competing
tokens whose logit exceeds τ_ρ, the logit above which the budget's share of competing tokens lay on calibration
blocks (the scorer's training split: no evaluation document). Each head keeps its floor. Each layer is capped so
that the running total never passes deferral's (the budget is never exceeded); a capped layer keeps its best tokens
jointly over its heads.

Both keep their tokens through the same cache (``AllocatedCache`` for the threshold's counts), the one-prefill tiers
of the evaluation's ``curkv_ragged`` row, on ``ppl_text`` examples. Per keep ratio it prints:
- ΔPPL % of each against the full cache, and the paired difference;
- the share of the budget the threshold asked for before its cap (mean, min, max over examples) and the share of
  layers the cap cut;
- the peak tokens held during the prefill as a share of the full cache.
"""

from __future__ import annotations

import argparse
import math

import torch
from transformers import DynamicCache

from curkv_train.core.selection import kept_count, share_of_compressible
from curkv_train.eval.allocated import AllocatedCache, RecordingCache, one_prefill, ragged_lengths
from curkv_train.eval.calibrate import calibration_documents
from curkv_train.eval.compressed import continuation_logits
from curkv_train.eval.heldout import training_hashes
from curkv_train.eval.metrics import continuation_sums
from curkv_train.eval.runtime_caches import continue_in_windows, prefill_budget, prefill_cache
from curkv_train.eval.tasks import DataRecipe, build_examples, load_streams
from curkv_train.runtime import load_scorer
from curkv_train.runtime.serialization import load_base_for


def competing(logits: dict[int, torch.Tensor], n_sink: int, window: int) -> torch.Tensor:
    """(layers, kv_heads, competing) logits of batch row 0's tokens that are neither sinks nor in the window."""
    return torch.stack([logits[layer][0, :, n_sink:logits[layer].shape[-1] - window] for layer in sorted(logits)])


def places_per_layer(tokens: int, heads: int, n_sink: int, window: int, keep: float) -> int:
    """Competing tokens a layer keeps in all under the one-prefill tiers at ``keep``: what one count per head keeps."""
    competitors = tokens - n_sink - window
    return heads * kept_count(competitors, share_of_compressible(competitors, n_sink + window, keep))


def threshold_counts(scores: torch.Tensor, tau: float, places: int, floor: int) -> tuple[torch.Tensor, float, int]:
    """Per (layer, head) competing tokens the threshold keeps, layer by layer under the running cap.

    Args:
        scores: (layers, kv_heads, competing) logits; ``places``: deferral's competing places per layer.

    Returns:
        ((layers, kv_heads) counts, the share of the budget asked for before the cap, the layers the cap cut).
    """
    layers, heads, _ = scores.shape
    counts = torch.zeros(layers, heads, dtype=torch.long)
    asked, used, cut = 0, 0, 0
    for layer in range(layers):
        wanted = torch.clamp((scores[layer] > tau).sum(-1), min=floor)
        asked += int(wanted.sum())
        cap = layers * places - used - (layers - layer - 1) * heads * floor
        if int(wanted.sum()) > cap:  # the best `cap` of the layer, each head its floor first
            cut += 1
            ranked = scores[layer].clone()
            ranked.scatter_(-1, ranked.topk(floor, dim=-1).indices, float("inf"))
            chosen = ranked.flatten().topk(cap).indices // scores.shape[-1]
            wanted = torch.bincount(chosen, minlength=heads)
        counts[layer] = wanted
        used += int(wanted.sum())
    return counts, asked / (layers * places), cut


def calibrated_tau(model, scorer, tokenizer, keep: float, context: int, count: int) -> float:
    """τ_ρ: the logit above which deferral's share of the competing tokens lies on ``count`` training blocks."""
    documents = calibration_documents(tokenizer, DataRecipe.of_scorer(scorer.metadata), length=context,
                                      per_source=max(1, count // 2))
    tiers = one_prefill(scorer.n_sink, scorer.window, 0)
    pooled = []
    for ids in documents[:count]:
        cache = RecordingCache(scorer, model, keep, layer_budget="uniform", tiers=tiers)
        prefill_cache(model, cache, ids)
        pooled.append(competing(cache.recorded, scorer.n_sink, scorer.window).flatten())
    logits = torch.cat(pooled)
    heads = next(iter(cache.recorded.values())).shape[1]
    share = places_per_layer(context, heads, scorer.n_sink, scorer.window, keep) / (
        heads * (context - scorer.n_sink - scorer.window))
    return float(logits.quantile(1.0 - share))


def relative_ppl(sums: list[dict], reference: list[dict]) -> float:
    """Perplexity increase (%) of summed NLLs over the full cache's."""
    nll = sum(s["nll"] for s in sums) - sum(s["nll"] for s in reference)
    return 100.0 * (math.exp(nll / sum(s["tokens"] for s in sums)) - 1.0)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scorer", default="smollm2-135m")
    parser.add_argument("--keeps", default="0.5,0.3,0.15")
    parser.add_argument("--examples", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--calibration", type=int, default=4)
    args = parser.parse_args()
    scorer = load_scorer(args.scorer)
    model, tokenizer = load_base_for(scorer)
    scorer = load_scorer(args.scorer, model=model)
    n_sink, window = scorer.n_sink, scorer.window
    recipe = DataRecipe.of_scorer(scorer.metadata)
    streams = load_streams(tokenizer, ["ppl_text"], recipe, training_hashes(tokenizer, list(recipe.sources)))
    examples = build_examples("ppl_text", tokenizer, streams, context_length=args.context,
                              continuation_length=args.continuation, examples=args.examples, seed=0,
                              protected=(n_sink, window), passkey_depths=[], passkey_lengths=[])
    tiers = one_prefill(n_sink, window, args.continuation)
    print("keep | ΔPPL % deferral | ΔPPL % threshold | threshold − deferral | asked (mean, min, max) | layers cut "
          "| peak: deferral, threshold")
    for keep in [float(k) for k in args.keeps.split(",")]:
        tau = calibrated_tau(model, scorer, tokenizer, keep, args.context, args.calibration)
        full, deferred, thresholded, asked, cut, peak = [], [], [], [], 0, []
        for example in examples:
            ids = example.input_ids
            context, continuation = ids[:, :args.context], ids[:, args.context:]
            plain = DynamicCache(config=model.config)
            model(input_ids=context, past_key_values=plain, use_cache=True)
            reference = continuation_logits(model, plain, continuation, args.context)
            full.append(continuation_sums(reference, reference, continuation, None))
            cache = RecordingCache(scorer, model, keep, layer_budget="uniform", tiers=tiers)
            prefill_budget(model, cache, context)
            lengths = ragged_lengths(cache)
            deferred.append(continuation_sums(continue_in_windows(model, cache, continuation), reference,
                                              continuation, None))
            scores = competing(cache.recorded, n_sink, window)
            layers, heads, _ = scores.shape
            places = places_per_layer(args.context, heads, n_sink, window, keep)
            floor = math.ceil(scorer.head_floor * places / heads - 1e-9)
            counts, share, layers_cut = threshold_counts(scores, tau, places, floor)
            asked.append(share)
            cut += layers_cut
            held = {layer: counts[index][None] + n_sink + window for index, layer in enumerate(sorted(lengths))}
            allocated = AllocatedCache(scorer, model, keep, scores=cache.recorded, lengths=held, tiers=tiers)
            prefill_budget(model, allocated, context)
            thresholded.append(continuation_sums(continue_in_windows(model, allocated, continuation), reference,
                                                 continuation, None))
            totals = [int(held[layer].sum()) for layer in sorted(held)]
            peak.append((sum(totals[:-1]) + heads * args.context) / (layers * heads * args.context))
        a, b = relative_ppl(deferred, full), relative_ppl(thresholded, full)
        print(f"{keep:g} | {a:.2f} | {b:.2f} | {b - a:+.2f} | {sum(asked) / len(asked):.3f} ({min(asked):.3f}, "
              f"{max(asked):.3f}) | {cut / (len(examples) * layers):.1%} | 1.000, {sum(peak) / len(peak):.3f}")


if __name__ == "__main__":
    main()
