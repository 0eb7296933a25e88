"""Greedy decoding speed and memory of CurKVCache settings against DynamicCache, in one process.

Usage: python benchmarks/bench_decode.py [--base embedded:smollm2-135m-instruct] [--scorer smollm2-135m]
       [--contexts 2048,4096,8192] [--keeps 0.5,0.3] [--new-tokens 256] [--threads 2]
       [--settings NAMES] [--backend auto] [--rounds 2] [--device cpu] [--dtype float32] [--random-weights]

For each context length a prompt of that many tokens (the Python standard library's sources: timing only) is
prefilled once per cache, then ``--new-tokens`` greedy steps are timed. Per cache it prints decode tokens/s, the
ratio to DynamicCache and to the default CurKVCache at the same keep ratio, the most bytes held after any step
(CurKVCache: ``nbytes()``), the share of decode time spent compressing and, inside it, scoring, and how many greedy
tokens agree with DynamicCache's; then one JSON line per run. Each cache runs ``--rounds`` times, the order reversed
each round; its fastest run is reported, with the speed-up per round beside it.

``--settings`` names entries of :data:`SETTINGS` (CurKVCache keywords; ``default`` is the runtime's defaults).
``--new-tokens`` should be a multiple of every setting's compression interval, so each compresses once per interval
timed. DynamicCache runs on its own copy of the base model, never hooked by a CurKVCache. The timing hooks live in
this script; docs/runtime.md ("Costs") has the measured figures.

``--device cuda --random-weights`` builds the base from its config (``data/model_configs``: no download) and prompts
with random tokens (no tokenizer): what ``benchmarks/gpu_checks.sh`` runs, ``graphs`` (the scoring replayed as CUDA
graphs, ``ComputeConfig(scoring_graphs=True)``) against ``default``. ``--scorer init:FAMILY`` takes an untrained
scorer (timing does not depend on the weights).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from curkv_train.models.base import load_tokenizer
from curkv_train.runtime import ComputeConfig, CurKVCache, TierConfig
from curkv_train.runtime.cache import compute_scorer
from curkv_train.runtime.layer import CurKVLayer
from bench_scoring_cost import load_model, make_scorer  # beside this script
from timing import TIMERS, clock, product_ms, timed  # benchmarks/timing.py, beside this script

SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "score-only": {"recent_share": 0.0},
    "cold": {"cold": True},
    "cold-rebuild": {"cold": True, "factored_attention": False},
    "cold-no-compensation": {"cold": True, "compensation": False},
    "cold-no-warm": {"cold": True, "warm": False},
    "no-hot": {"hot": False},
    "uniform": {"layer_budget": "uniform"},
    "every-window": {"compress_every": 1, "hot_windows": 3},
    "compiled": {"compile_scorer": True},
    "graphs": {"scoring_graphs": True},
    "medium": {"scorer_precision": "medium"},
    "compiled-medium": {"compile_scorer": True, "scorer_precision": "medium"},
}
BASELINE = "dynamic"
DEFAULT = "default"


def cache_options(setting: dict[str, Any], keep: float, backend: str) -> dict[str, Any]:
    """CurKVCache's keywords for a ``SETTINGS`` entry (TierConfig and ComputeConfig fields among the others) at keep
    ratio ``keep`` on kernel ``backend``."""
    tier_fields = {field.name for field in dataclasses.fields(TierConfig)}
    compute_fields = {field.name for field in dataclasses.fields(ComputeConfig)}
    tiers = {name: value for name, value in setting.items() if name in tier_fields}
    compute = {"backend": backend, **{name: value for name, value in setting.items() if name in compute_fields}}
    rest = {name: value for name, value in setting.items() if name not in tier_fields | compute_fields}
    return {"keep_ratio": keep, **rest, "tiers": TierConfig(**tiers), "compute": ComputeConfig(**compute)}


def instrument() -> None:
    """Time compression and scoring (class-level wrappers, this process only)."""
    CurKVLayer.compress = timed("compress", CurKVLayer.compress)
    CurKVCache._score = timed("score", CurKVCache._score)


def stdlib_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """(1, tokens) ids of the standard library's sources (sorted files, repeated if short)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    ids: list[int] = []
    while len(ids) < tokens:
        for path in files:
            ids += tokenizer(path.read_text(errors="ignore"), add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                break
    return torch.tensor([ids[:tokens]])


def held_bytes(cache) -> int:
    """Bytes the cache holds: CurKVCache.nbytes(), or a DynamicCache's K/V."""
    if isinstance(cache, CurKVCache):
        return cache.nbytes()
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@torch.no_grad()
def decode(model, cache, prompt: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Prefill ``prompt`` then ``new_tokens`` timed greedy steps; seconds of each phase, the tokens, what is held
    (and a CurKVCache's tiers)."""
    start = clock()
    logits = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    prefill_s = clock() - start
    TIMERS.clear()
    tokens = [int(logits[0, -1].argmax())]
    steps, peak_bytes = [], 0
    for _ in range(new_tokens):
        token = torch.tensor([[tokens[-1]]], device=prompt.device)
        start = time.perf_counter()
        logits = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        tokens.append(int(logits[0, -1].argmax()))
        steps.append(time.perf_counter() - start)
        peak_bytes = max(peak_bytes, held_bytes(cache))
    decode_s = sum(steps)
    result = {"prefill_s": prefill_s, "decode_s": decode_s, "median_step_s": sorted(steps)[len(steps) // 2],
              "tokens": tokens,
              "compress_s": TIMERS["compress"], "score_s": TIMERS["score"], "bytes": peak_bytes}
    if isinstance(cache, CurKVCache):
        result |= {"tiers": cache.tier_sizes(0), "factored": cache.factored_attention}
    return result


def run_context(model, plain_model, scorer, prompt: torch.Tensor, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cache at one context length (DynamicCache on ``plain_model``, a copy of ``model`` no CurKVCache
    hooks); rows with tokens/s, bytes and ratios."""
    runs = [(BASELINE, None, lambda: DynamicCache(config=model.config))]
    for keep in args.keeps:
        for name in args.settings:
            options = cache_options(SETTINGS[name], keep, args.backend)
            made = compute_scorer(scorer, options["compute"])  # compiled once for every round's cache
            runs.append((name, keep, functools.partial(CurKVCache, made, model=model, **options)))
    rounds: dict[int, list[dict[str, Any]]] = {index: [] for index in range(len(runs))}  # every run, by round
    for round_index in range(args.rounds):
        # alternate the order: a run's place in the sequence shifts its speed on this machine
        order = list(enumerate(runs)) if round_index % 2 == 0 else list(enumerate(runs))[::-1]
        for index, (name, keep, make) in order:
            cache = make()
            rounds[index].append(decode(plain_model if name == BASELINE else model, cache, prompt, args.new_tokens))
            if isinstance(cache, CurKVCache):
                cache.close()  # the model's hooks go with it, before the next run
    rows = []
    for index, (name, keep, _) in enumerate(runs):
        result = min(rounds[index], key=lambda run: run["decode_s"])
        steps = args.new_tokens
        row = {"context": prompt.shape[-1], "cache": name, "keep": keep, "tok_s": steps / result["decode_s"],
               "median_step_ms": 1000 * result["median_step_s"], "prefill_s": result["prefill_s"],
               "bytes": result["bytes"],
               "compress_share": result["compress_s"] / result["decode_s"],
               "score_share": result["score_s"] / result["decode_s"], "tokens": result["tokens"]}
        row |= {key: result[key] for key in ("tiers", "factored") if key in result}
        # the speed-up within each round (DynamicCache ran next to it): its spread is this machine's noise
        row["vs_dynamic_rounds"] = sorted(base["decode_s"] / own["decode_s"]
                                          for base, own in zip(rounds[0], rounds[index]))
        rows.append(row)
        print(f"  {name:16s} keep {keep if keep is not None else '-':>4}: {row['tok_s']:6.2f} tok/s "
              f"(best of {args.rounds})", flush=True)
    baseline = rows[0]
    for row in rows:
        default = next((r for r in rows if r["cache"] == DEFAULT and r["keep"] == row["keep"]), None)
        row["vs_dynamic"] = row["tok_s"] / baseline["tok_s"]
        row["vs_default"] = None if default is None else row["tok_s"] / default["tok_s"]
        row["bytes_vs_dynamic"] = row["bytes"] / baseline["bytes"]
        row["token_agreement"] = sum(a == b for a, b in zip(row["tokens"], baseline["tokens"])) / len(row["tokens"])
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per cache: speed, ratios, memory, compression share, agreement."""
    print(f"context {rows[0]['context']} (decode steps timed after prefill; ratios from this run)")
    print(f"  {'cache':16s} {'keep':>4s} {'tok/s':>7s} {'med ms':>7s} {'vs dyn':>7s} {'vs dflt':>8s} {'MiB held':>9s} "
          f"{'mem/dyn':>7s} {'compress':>8s} {'score':>6s} {'agree':>6s} {'cold':>5s}  vs dyn per round: median [min, max]")
    for row in rows:
        keep = "-" if row["keep"] is None else f"{row['keep']:.2f}"
        versus_default = "-" if row["vs_default"] is None else f"{row['vs_default']:.2f}x"
        cold = row.get("tiers", {}).get("cold", "-")
        print(f"  {row['cache']:16s} {keep:>4s} {row['tok_s']:7.2f} {row['median_step_ms']:7.1f} "
              f"{row['vs_dynamic']:6.2f}x {versus_default:>8s} "
              f"{row['bytes'] / 2**20:9.2f} {row['bytes_vs_dynamic']:7.2f} {row['compress_share']:8.1%} "
              f"{row['score_share']:6.1%} {row['token_agreement']:6.2f} {cold!s:>5s}  {rounds_range(row)}")


def rounds_range(row: dict[str, Any]) -> str:
    """The per-round speed-ups over DynamicCache as ``median [min, max]``."""
    ratios = row["vs_dynamic_rounds"]
    return f"{statistics.median(ratios):.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}]"


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def csv_floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def csv_settings(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    unknown = sorted(set(names) - set(SETTINGS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown settings {unknown}; choose from {', '.join(SETTINGS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--scorer", default="smollm2-135m", help="scorer folder or shipped checkpoint name")
    parser.add_argument("--contexts", type=csv_ints, default=[2048, 4096, 8192], help="prompt lengths, comma-separated")
    parser.add_argument("--keeps", type=csv_floats, default=[0.5, 0.3], help="keep ratios, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=256, help="timed greedy decode steps per run")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every cache, in alternating order; each cache's fastest run is reported")
    parser.add_argument("--settings", type=csv_settings, default=list(SETTINGS),
                        help=f"CurKVCache settings, comma-separated from: {', '.join(SETTINGS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--backend", default="auto", help="kernel backend of CurKVCache (auto, torch, triton)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--random-weights", action="store_true",
                        help="build the base from its config and prompt with random tokens")
    args = parser.parse_args()
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1 (one timed decode step)")
    torch.set_num_threads(args.threads)
    instrument()
    model = load_model(args.base, random_weights=args.random_weights, layers=None, dtype=getattr(torch, args.dtype),
                       device=args.device)
    plain_model = copy.deepcopy(model)  # DynamicCache's: never hooked by a CurKVCache
    scorer = make_scorer(args.scorer, model)
    if args.random_weights:
        generator = torch.Generator().manual_seed(0)
        prompts = {context: torch.randint(0, model.config.vocab_size, (1, context), generator=generator)
                   for context in args.contexts}
    else:
        tokenizer = load_tokenizer(args.base)
        prompts = {context: stdlib_prompt(tokenizer, context) for context in args.contexts}
    prompts = {context: prompt.to(args.device) for context, prompt in prompts.items()}
    print(f"{args.base}, scorer {args.scorer}, {args.threads} threads, {args.new_tokens} new tokens, "
          f"attention {model.config._attn_implementation}, {args.device} {args.dtype}; host check: "
          f"{product_ms(args.device):.2f} ms", flush=True)
    results = []
    for context, prompt in prompts.items():
        rows = run_context(model, plain_model, scorer, prompt, args)
        print_table(rows)
        results += rows
    print(f"host check at the end: {product_ms(args.device):.2f} ms (timing.product_ms)")
    for row in results:
        row.pop("tokens")
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))


if __name__ == "__main__":
    main()
