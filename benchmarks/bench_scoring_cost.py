"""What scoring costs at prefill: a CurKVCache prefill against a plain DynamicCache prefill, in one process.

Usage: python benchmarks/bench_scoring_cost.py [--base embedded:smollm2-135m-instruct] [--scorer smollm2-135m]
       [--contexts 1024,4096] [--repeats 5] [--threads 2] [--device cpu] [--dtype float32]
       [--random-weights] [--layers N] [--compile] [--skip-features NAMES] [--feature-backend auto]
       [--scorer-precision highest] [--scoring-batch-tokens N] [--decode-steps N]

Both prefills compute the last token's logits only, as ``generate`` does. For each context length it prints the
median plain prefill and what the cache (keep 0.5, dense tiers) adds, as shares of it: observing (the hooks'
recording and the query statistics), scoring (features + estimator) and selecting (top-k, compaction), the score
share's range over rounds, the whole overhead from prefills timed without the parts' timers, the minor page faults
scoring takes, and the aten operators and Triton launches the cache adds per layer (:mod:`operator_count`); then one
JSON line per context. A host check at start and end (:func:`timing.product_ms`) tells a slow host apart.

``--scorer`` takes a folder, a shipped name or ``init:FAMILY`` (timing does not depend on the weights).
``--random-weights`` builds the base from its config (offline for the configs in ``data/model_configs``) and
``--layers N`` keeps its first N layers: the shares are per layer. ``--compile`` scores through
``Scorer.compiled()``. ``--skip-features NAMES`` replaces those query features by constants (cost only).
``--feature-backend torch`` keeps the features off the fused Triton kernels that ``auto`` takes on CUDA.
``--scorer-precision medium`` scores with bfloat16 products and also prints how far the scores move from
``highest``. ``--decode-steps N`` also counts the operators a decode step through the cache adds per layer, over N
greedy steps after the prefill (its re-compressions included). The timing hooks live in this script;
docs/runtime.md ("Costs") has the measured figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from curkv_train.core import features
from curkv_train.core.shapes import kv_shape
from curkv_train.models.base import freeze, load_base_model
from curkv_train.models.configs import load_model_config
from curkv_train.models.families import build_estimator
from curkv_train.runtime import CurKVCache, Scorer, TierConfig, load_scorer
from curkv_train.runtime.layer import CurKVLayer
from operator_count import added_per_layer, decode_added_per_layer  # beside this script
from timing import FAULTS, TIMERS, clock, product_ms, timed  # benchmarks/timing.py, beside this script


@contextmanager
def instrumented() -> Iterator[None]:
    """Time observation, scoring and eviction inside CurKVCache while in the block (this process only)."""
    targets = [(CurKVLayer, "observe_queries", "observe"), (CurKVLayer, "observe_hidden", "observe"),
               (CurKVLayer, "_evict", "evict"), (CurKVCache, "_score", "score"),
               (CurKVCache, "_score_layers", "group_score"), (CurKVCache, "compress_jointly", "joint")]
    originals = [getattr(owner, name) for owner, name, _ in targets]
    for owner, name, timer in targets:
        setattr(owner, name, timed(timer, getattr(owner, name)))
    try:
        yield
    finally:
        for (owner, name, _), original in zip(targets, originals):
            setattr(owner, name, original)


def _zeros_standing_in_for(name: str) -> Callable[..., torch.Tensor]:
    """A stand-in for the torch-path function ``name`` of curkv_train.core.features: zeros of its output's shape."""
    shapes = {"window_mass": lambda queries, keys, *rest: keys.shape[:3],  # (b, h, n)
              "expected_logits": lambda mean, covariance, keys, *rest: (*mean.shape[:3], keys.shape[2]),  # (b, h, g, n)
              "head_output_norms": lambda module, values, *rest: (*values.shape[:2], 1, values.shape[2])}  # (b, h, 1, n)
    return lambda *args, **kwargs: args[1].new_zeros(shapes[name](*args))


# skippable query feature -> the torch-path function of curkv_train.core.features computing its attention-sized part
SKIPPABLE = {"window_attention": "window_mass", "expected_attention": "expected_logits",
             "output_norm": "head_output_norms"}


def skip_features(names: list[str]) -> None:
    """Replace the named query features' attention-sized parts by zeros in this process (the torch path: skipping
    forces it)."""
    for name in names:
        setattr(features, SKIPPABLE[name], _zeros_standing_in_for(SKIPPABLE[name]))
    if names:
        force_feature_backend("torch")


def force_feature_backend(backend: str) -> None:
    """Make every query-feature computation in this process use ``backend`` (auto: leave the choice as it is)."""
    if backend != "auto":
        features.feature_backend = lambda *args, _backend=backend: _backend


def load_model(base: str, *, random_weights: bool, layers: int | None, dtype: torch.dtype,
               device: str) -> PreTrainedModel:
    """The base model on ``device``, or (``random_weights``) one built from its config, first ``layers`` layers."""
    if not random_weights:
        return load_base_model(base, dtype=dtype, attn_implementation="sdpa").to(device)
    config = load_model_config(base)
    config.num_hidden_layers = layers or config.num_hidden_layers
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a large geometry never sits in host memory
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.name_or_path = base
    return freeze(model)


def make_scorer(spec: str, model) -> Scorer:
    """A scorer from a folder / shipped name, or an untrained one for ``init:FAMILY``."""
    if spec.startswith("init:"):
        torch.manual_seed(0)
        return Scorer(build_estimator(spec.removeprefix("init:"), kv_shape(model.config)).eval())
    return load_scorer(spec, model=model)


def agreement(model, scorer: Scorer, context: int) -> str:
    """How ``scorer``'s logits compare with the same scorer's at ``highest`` precision on the same inputs, over
    one CurKVCache prefill of ``context`` random tokens: the mean and least overlap of the top half per
    (layer, KV head), and the largest logit difference."""
    pairs, original = [], Scorer.score_layer

    def both(self, *args, **kwargs):
        tested = original(self, *args, **kwargs)
        pairs.append((original(dataclasses.replace(self, matmul_precision="highest"), *args, **kwargs), tested))
        return tested

    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(1))
    Scorer.score_layer = both
    try:
        with torch.no_grad():
            model(ids.to(model.device), past_key_values=CurKVCache(scorer, model=model, keep_ratio=0.5),
                  logits_to_keep=1)
    finally:
        Scorer.score_layer = original
    reference, tested = (torch.stack(side) for side in zip(*pairs))  # (layers, batch, kv_heads, tokens)
    half = reference.shape[-1] // 2
    kept = [logits.topk(half, dim=-1).indices.sort(dim=-1).values for logits in (reference, tested)]
    overlap = (kept[0].unsqueeze(-1) == kept[1].unsqueeze(-2)).sum(dim=(-1, -2)).float() / half
    return (f"{scorer.matmul_precision} vs highest, {context} tokens: top-half overlap mean {overlap.mean():.4f}, "
            f"least {overlap.min():.4f}; largest logit change {(reference - tested).abs().max().item():.3f}")


def seconds(run: Callable[[], None]) -> float:
    """Wall time of one ``run()`` (GPU work included)."""
    start = clock()
    run()
    return clock() - start


def measure(model, scorer: Scorer, context: int, repeats: int, batch_tokens: int | None = None,
            allocation: str | None = None) -> dict:
    """Plain and CurKVCache prefill times and the cache's parts for one context length.

    Each of ``repeats`` rounds (after one warm-up round) runs a plain prefill, a CurKVCache prefill
    (``batch_tokens``: its ``scoring_batch_tokens``, None: its allocation's default) and an instrumented one back
    to back, so drifts of a shared machine hit all three alike; medians over rounds.
    """
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(model.device)

    def plain() -> None:
        with torch.no_grad():
            model(ids, past_key_values=DynamicCache(config=model.config), logits_to_keep=1)

    def cached() -> None:
        with torch.no_grad():
            cache = CurKVCache(scorer, model=model, keep_ratio=0.5,
                               tiers=TierConfig(scoring_batch_tokens=batch_tokens, allocation=allocation))
            model(ids, past_key_values=cache, logits_to_keep=1)

    rounds = []
    for _ in range(repeats + 1):
        plain_s, cached_s = seconds(plain), seconds(cached)
        TIMERS.clear()
        FAULTS.clear()
        with instrumented():  # apart: the timers wait for the GPU, which an uninstrumented prefill overlaps
            cached()
        # a layer scored alone is scored inside its eviction; a group of layers, before theirs; under the joint
        # allocation a prefill's first compression scores every group inside compress_jointly, then selects
        joint_select = TIMERS["joint"] - TIMERS["group_score"] if TIMERS["joint"] else 0.0
        parts = {"observe": TIMERS["observe"], "score": TIMERS["score"] + TIMERS["group_score"],
                 "select": TIMERS["evict"] - TIMERS["score"] + joint_select}
        rounds.append({"plain": plain_s, "cached": cached_s, **parts,
                       "score_faults": FAULTS["score"] + FAULTS["group_score"]})
    rounds = rounds[1:]  # the warm-up round
    plain_s = statistics.median([r["plain"] for r in rounds])
    parts = {k: statistics.median([r[k] for r in rounds]) for k in ("observe", "score", "select")}
    shares = {k: [r[k] / r["plain"] for r in rounds] for k in parts}  # per round
    return {"context": context, "family": scorer.family, "device": str(model.device), "dtype": str(model.dtype),
            "layers": model.config.num_hidden_layers, "rounds": repeats, "plain_prefill_s": round(plain_s, 4),
            "cache_prefill_s": round(statistics.median([r["cached"] for r in rounds]), 4),
            **{f"{k}_s": round(v, 4) for k, v in parts.items()},
            **{f"{k}_share": round(statistics.median(shares[k]), 4) for k in parts},
            "score_share_range": [round(f(shares["score"]), 4) for f in (min, max)],
            "score_page_faults": int(statistics.median([r["score_faults"] for r in rounds])),
            "overhead_share": round(statistics.median([r["cached"] / r["plain"] - 1 for r in rounds]), 4)}


def operators_added(model, scorer: Scorer, context: int, batch_tokens: int | None,
                    allocation: str | None = None) -> dict:
    """Aten operators and Triton launches per layer that a CurKVCache prefill adds (operator_count.py)."""
    tiers = TierConfig(scoring_batch_tokens=batch_tokens, allocation=allocation)
    return added_per_layer(model, lambda: CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=tiers), context)


def decode_operators_added(model, scorer: Scorer, context: int, steps: int, allocation: str | None = None) -> dict:
    """Aten operators and Triton launches per layer and decode step that a CurKVCache adds (operator_count.py)."""
    tiers = TierConfig(allocation=allocation)
    return decode_added_per_layer(model, lambda: CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=tiers),
                                  context, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--scorer", default="smollm2-135m")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--repeats", type=int, default=5, help="measured rounds (after a warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--random-weights", action="store_true", help="build the base from its config only")
    parser.add_argument("--layers", type=int, default=None, help="keep the base's first N layers")
    parser.add_argument("--compile", action="store_true", help="score through torch.compile (Scorer.compiled)")
    parser.add_argument("--skip-features", default="", help=f"comma-separated subset of {', '.join(SKIPPABLE)}: "
                        "timed as constants (what scoring would cost without them)")
    parser.add_argument("--feature-backend", default="auto", choices=["auto", "torch", "triton"],
                        help="who computes the query features' attention-sized parts (auto: Triton on CUDA, eager)")
    parser.add_argument("--scoring-batch-tokens", type=int, default=None,
                        help="CurKVCache's scoring_batch_tokens: a prefill's layers scored together (0: one at a time; "
                        "default: the allocation's, 4096 per_head, 131072 joint)")
    parser.add_argument("--scorer-precision", default="highest", choices=["highest", "medium"],
                        help="the query features' products: float32 (highest) or from bfloat16 operands (medium)")
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="also count the operators a decode step adds, over this many steps")
    parser.add_argument("--allocation", default=None, choices=["per_head", "joint"],
                        help="CurKVCache's allocation (default: the one the scorer was trained under)")
    args = parser.parse_args()
    if args.layers is not None and not args.random_weights:
        parser.error("--layers builds a truncated model from the config: pass --random-weights with it")
    skipped = [name for name in args.skip_features.split(",") if name]
    if unknown := sorted(set(skipped) - set(SKIPPABLE)):
        parser.error(f"unknown feature(s) {', '.join(unknown)}; expected some of {', '.join(SKIPPABLE)}")
    if skipped and args.feature_backend == "triton":
        parser.error("--skip-features replaces parts of the torch path: it cannot go with --feature-backend triton")
    force_feature_backend(args.feature_backend)
    skip_features(skipped)
    torch.set_num_threads(args.threads)
    model = load_model(args.base, random_weights=args.random_weights, layers=args.layers,
                       dtype=getattr(torch, args.dtype), device=args.device)
    scorer = dataclasses.replace(make_scorer(args.scorer, model), matmul_precision=args.scorer_precision)
    if args.scorer_precision != "highest":
        print(agreement(model, scorer, int(args.contexts.split(",")[0])))
    scorer = scorer.compiled() if args.compile else scorer  # compiled by the warm-up prefill, not timed
    print(f"host check: {product_ms(args.device):.2f} ms (timing.product_ms)")
    print(f"{'context':>8} {'prefill s':>10} {'cache s':>9} {'observe':>8} {'score':>8} {'select':>8} {'overhead':>9}")
    rows = []
    for context in map(int, args.contexts.split(",")):
        row = {**measure(model, scorer, context, args.repeats, args.scoring_batch_tokens, args.allocation),
               "allocation": args.allocation or scorer.allocation, "compiled": args.compile,
               "scoring_batch_tokens": args.scoring_batch_tokens, "skipped_features": skipped,
               "feature_backend": args.feature_backend}
        row["operators"] = operators_added(model, scorer, context, args.scoring_batch_tokens, args.allocation)
        if args.decode_steps:
            row["decode_operators"] = decode_operators_added(model, scorer, context, args.decode_steps,
                                                             args.allocation)
        rows.append(row)
        print(f"{context:>8} {row['plain_prefill_s']:>10.3f} {row['cache_prefill_s']:>9.3f} "
              f"{row['observe_share']:>8.1%} {row['score_share']:>8.1%} {row['select_share']:>8.1%} "
              f"{row['overhead_share']:>9.1%}")
    print(f"shares are of the plain prefill, medians of the rounds; target: score <= 5 %; host check at the end: "
          f"{product_ms(args.device):.2f} ms")
    for row in rows:
        low, high = row["score_share_range"]
        print(f"{row['context']:>8}: score share per round {low:.1%} to {high:.1%}; "
              f"{row['score_page_faults']} page faults scoring a prefill")
        operators = row["operators"]
        print(f"{row['context']:>8}: the cache adds {operators['operators_per_layer']:.1f} operators per layer "
              f"({operators['aten_per_layer']:.1f} aten, {operators['triton_per_layer']:.1f} Triton launches; "
              f"the plain prefill dispatches {operators['plain_aten_per_layer']:.1f} aten operators per layer)")
        if "decode_operators" in row:
            decode = row["decode_operators"]
            print(f"{row['context']:>8}: a decode step adds {decode['operators_per_layer_step']:.1f} operators per "
                  f"layer ({decode['aten_per_layer_step']:.1f} aten, {decode['triton_per_layer_step']:.1f} Triton "
                  f"launches; the plain step dispatches {decode['plain_aten_per_layer_step']:.1f} aten operators per "
                  f"layer), over {decode['steps']} steps")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
