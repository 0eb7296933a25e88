"""GPU benchmark: fused Triton scored attention vs SDPA with a float mask vs FlexAttention.

Workload (defaults): batch 1, M = 512 new queries attending bottom-right causally to
N in {4K, 8K, 16K, 32K} cached keys, GQA 64 query heads : 8 KV heads (Llama-2-70B layer
geometry), head_dim 128, bf16 q/k/v, an fp32 per-(KV head, key) bias with 25% of the
keys evicted (-inf). Every method computes the same function and its gradients w.r.t.
q and the bias (k / v are a frozen cache):

* ``triton``: :func:`curkv_train.kernels.scored_attention` with ``backend="triton"``.
* ``sdpa``: ``F.scaled_dot_product_attention`` with the bias and the causal mask
  materialized as a per-query-head bf16 float mask [B, Hq, M, N] built from the bias
  inside the timed step (so autograd reduces the mask gradient back to the bias); K / V
  are expanded to Hq heads once, outside the timed step.
* ``flex``: compiled ``flex_attention`` with a ``score_mod`` reading the bias, a causal
  block mask, and ``enable_gqa=True``.

Times are CUDA-event means over ``--iters`` runs after ``--warmup`` runs (compilation
and autotuning happen in the warm-up); "peak" is the peak allocated memory of one
forward+backward step above what was allocated before it (inputs excluded). Ratios
are against SDPA measured in the same run. A baseline that runs out of memory or fails
is reported as such. The last line printed is a JSON record of every measurement.

Usage:
    python benchmarks/bench_scored_attention.py [--n 4096 8192 16384 32768] [--m 512]
        [--q-heads 64] [--kv-heads 8] [--head-dim 128] [--warmup 5] [--iters 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from curkv_train.kernels import scored_attention
from curkv_train.kernels.reference import causal_key_mask

METHODS = ("triton", "sdpa", "flex")
EVICTED_FRACTION = 0.25


@dataclass
class Problem:
    """Inputs of one benchmark point: q and bias are leaves that require grad."""

    q: torch.Tensor  # (B, Hq, M, d)
    k: torch.Tensor  # (B, Hkv, N, d)
    v: torch.Tensor  # (B, Hkv, N, d)
    bias: torch.Tensor  # (B, Hkv, N) float32
    grad_out: torch.Tensor  # (B, Hq, M, d)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.q.shape[1] // self.k.shape[1]


def make_problem(batch: int, q_heads: int, kv_heads: int, num_queries: int, num_keys: int,
                 head_dim: int, dtype: torch.dtype, device: str, seed: int = 0) -> Problem:
    """Random inputs; a fixed fraction of keys per KV head is evicted with a -inf bias."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    bias = randn(batch, kv_heads, num_keys, dt=torch.float32)
    evicted = torch.rand(bias.shape, generator=gen, device=device) < EVICTED_FRACTION
    bias = bias.masked_fill(evicted, float("-inf")).requires_grad_()
    return Problem(
        q=randn(batch, q_heads, num_queries, head_dim).requires_grad_(),
        k=randn(batch, kv_heads, num_keys, head_dim),
        v=randn(batch, kv_heads, num_keys, head_dim),
        bias=bias,
        grad_out=randn(batch, q_heads, num_queries, head_dim),
    )


# --------------------------------------------------------------------------- methods


def triton_method(p: Problem) -> Callable[[], torch.Tensor]:
    """Fused kernel: attention output from (q, k, v, bias)."""
    return lambda: scored_attention(p.q, p.k, p.v, p.bias, causal=True, backend="triton")


def sdpa_method(p: Problem) -> Callable[[], torch.Tensor]:
    """SDPA with the bias + causal mask materialized per query head as a bf16 float mask."""
    num_queries, num_keys = p.q.shape[2], p.k.shape[2]
    visible = causal_key_mask(num_queries, num_keys, p.q.device)
    causal = torch.zeros(visible.shape, device=p.q.device).masked_fill(~visible, float("-inf"))
    k = p.k.repeat_interleave(p.group, dim=1)
    v = p.v.repeat_interleave(p.group, dim=1)

    def run() -> torch.Tensor:
        mask = (p.bias[:, :, None, :] + causal).to(p.q.dtype)  # (B, Hkv, M, N)
        mask = mask.repeat_interleave(p.group, dim=1)  # (B, Hq, M, N)
        return F.scaled_dot_product_attention(p.q, k, v, attn_mask=mask)

    return run


def flex_method(p: Problem) -> Callable[[], torch.Tensor]:
    """Compiled FlexAttention: score_mod adds the bias, a block mask applies causality."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    num_queries, num_keys = p.q.shape[2], p.k.shape[2]
    offset, group, bias = num_keys - num_queries, p.group, p.bias

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def add_bias(score, b, h, q_idx, kv_idx):
        return score + bias[b, h // group, kv_idx]

    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=num_queries, KV_LEN=num_keys,
                                   device=p.q.device)
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(p.q, p.k, p.v, score_mod=add_bias, block_mask=block_mask,
                            enable_gqa=True)


BUILDERS = {"triton": triton_method, "sdpa": sdpa_method, "flex": flex_method}


# --------------------------------------------------------------------------- measurement


def train_step(p: Problem, forward: Callable[[], torch.Tensor]) -> None:
    """One forward + backward w.r.t. q and the bias (fresh gradients)."""
    p.q.grad = None
    p.bias.grad = None
    forward().backward(p.grad_out)


def cuda_time_ms(fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Mean CUDA-event time of fn in milliseconds after warm-up runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def peak_mib(p: Problem, fn: Callable[[], object]) -> float:
    """Peak allocated MiB of one call of fn above the memory allocated before it."""
    p.q.grad = None
    p.bias.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def outputs(p: Problem, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, bias gradient) of one step, in float32, for the cross-method check."""
    p.q.grad = None
    p.bias.grad = None
    out = forward()
    out.backward(p.grad_out)
    return out.detach().float(), p.bias.grad.detach().float().clone()


def measure(p: Problem, method: str, warmup: int, iters: int) -> dict:
    """Times, peak memory and outputs of one method; status 'ok', 'OOM' or 'error: ...'."""
    try:
        forward = BUILDERS[method](p)
        step = lambda: train_step(p, forward)  # noqa: E731
        with torch.no_grad():
            fwd_ms = cuda_time_ms(forward, warmup, iters)
        step_ms = cuda_time_ms(step, warmup, iters)
        peak = peak_mib(p, step)
        out, dbias = outputs(p, forward)
        return {"status": "ok", "fwd_ms": fwd_ms, "fwd_bwd_ms": step_ms, "peak_mib": peak,
                "out": out, "dbias": dbias}
    except torch.cuda.OutOfMemoryError:
        return {"status": "OOM"}
    except Exception as exc:  # a baseline unsupported by this torch build is reported
        return {"status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}


def free_memory(p: Problem) -> None:
    """Drop gradients and cached blocks between methods so peaks do not interfere."""
    p.q.grad = None
    p.bias.grad = None
    gc.collect()
    torch.cuda.empty_cache()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| over entries finite in both (evicted keys have 0 gradient everywhere)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    return (a[both] - b[both]).abs().max().item() if both.any() else None


def summarize(results: dict) -> dict:
    """Add ratios against SDPA and errors against the Triton kernel; drop the tensors."""
    sdpa, ref = results.get("sdpa", {}), results.get("triton", {})
    for method, r in results.items():
        if r["status"] != "ok":
            continue
        if sdpa.get("status") == "ok":
            r["speedup_vs_sdpa"] = sdpa["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            r["fwd_speedup_vs_sdpa"] = sdpa["fwd_ms"] / r["fwd_ms"]
            r["peak_vs_sdpa"] = r["peak_mib"] / sdpa["peak_mib"] if sdpa["peak_mib"] else None
        if ref.get("status") == "ok" and method != "triton":
            r["max_abs_dout_vs_triton"] = max_abs_diff(r["out"], ref["out"])
            r["max_abs_ddbias_vs_triton"] = max_abs_diff(r["dbias"], ref["dbias"])
    for r in results.values():
        r.pop("out", None)
        r.pop("dbias", None)
    return results


def fmt(value, spec: str) -> str:
    """Format a number, or a right-aligned '-' of the same width when missing."""
    return "-".rjust(int(spec.split(".")[0])) if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    """Human-readable table, one line per (N, method)."""
    head = (f"{'N':>6} {'method':>7} {'fwd ms':>8} {'fwd+bwd ms':>11} {'peak MiB':>9} "
            f"{'x SDPA fwd':>10} {'x SDPA f+b':>10} {'mem/SDPA':>9} {'|dO| vs tri':>11} "
            f"{'|dbias| vs tri':>14}  status")
    print(head)
    print("-" * len(head))
    for row in rows:
        print(f"{row['N']:>6} {row['method']:>7} {fmt(row.get('fwd_ms'), '8.3f')} "
              f"{fmt(row.get('fwd_bwd_ms'), '11.3f')} {fmt(row.get('peak_mib'), '9.1f')} "
              f"{fmt(row.get('fwd_speedup_vs_sdpa'), '10.2f')} "
              f"{fmt(row.get('speedup_vs_sdpa'), '10.2f')} {fmt(row.get('peak_vs_sdpa'), '9.2f')} "
              f"{fmt(row.get('max_abs_dout_vs_triton'), '11.2e')} "
              f"{fmt(row.get('max_abs_ddbias_vs_triton'), '14.2e')}  {row['status']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; defaults are the workload described in the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--m", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run every (N, method) point, print the table and a JSON line."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_scored_attention.py needs a CUDA GPU (torch.cuda.is_available() is "
                 "False); the CPU interpreter path is only for tests.")
    config = {"batch": args.batch, "M": args.m, "q_heads": args.q_heads,
              "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16",
              "causal": "bottom-right", "evicted_fraction": EVICTED_FRACTION,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    print(json.dumps({"config": config}))
    rows = []
    for num_keys in args.n:
        p = make_problem(args.batch, args.q_heads, args.kv_heads, args.m, num_keys,
                         args.head_dim, torch.bfloat16, "cuda")
        results = {}
        for method in args.methods:
            results[method] = measure(p, method, args.warmup, args.iters)
            free_memory(p)
        for method, r in summarize(results).items():
            rows.append({"N": num_keys, "method": method, **r})
            print(json.dumps(rows[-1]), flush=True)  # a run cut off early keeps what it measured
        del p
        gc.collect()
        torch.cuda.empty_cache()
    print_table(rows)
    print(json.dumps({"config": config, "results": rows}))


if __name__ == "__main__":
    main()
