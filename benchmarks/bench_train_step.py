"""One training step vs one plain forward of the same tokens, in one process.

Usage: python benchmarks/bench_train_step.py [--base embedded:smollm2-135m-instruct]
       [--context 1024] [--continuation 128] [--repeats 3] [--estimator seed|query_aware|hidden]
       [--dense_weight 0.0] [--warm_start] [--streaming_rounds 0]

The step is CurKVModule.training_step (prefill, reconstruction pass if the dense term is on,
teacher, student forward/backward) plus the optimizer step, hard top-k at keep 0.5.

Prints seconds per call, the ratio train-step / plain-forward (target <= 3x) and peak
memory (CUDA: max allocated; CPU: growth of the process's peak RSS over each phase).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from curkv_train.training.objective import TrainingSettings
from curkv_train.training.system import CurKVModule


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far: CUDA max allocated, else the process's peak RSS (MiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--continuation", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--estimator", default="seed", choices=("seed", "query_aware", "hidden"))
    parser.add_argument("--dense_weight", type=float, default=0.0)
    parser.add_argument("--warm_start", action="store_true")
    parser.add_argument("--streaming_rounds", type=int, default=0)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    module = CurKVModule(base_model=args.base, window=64, backend="auto", estimator=args.estimator,
                         dense_weight=args.dense_weight)
    module.configure_model()
    module.to(device)
    module.apply_stage(TrainingSettings(keep_ratio=0.5, hard_topk=True, warm_start=args.warm_start,
                                        streaming_rounds=args.streaming_rounds))
    module.log = module.log_dict = lambda *args, **kwargs: None  # no trainer attached
    optimizer = module.configure_optimizers()
    vocab = module.base.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.context + args.continuation), device=device)

    def plain_forward() -> None:
        with torch.no_grad():
            module.base(ids)

    def train_step() -> None:
        loss = module.training_step({"input_ids": ids, "context_length": args.context}, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    before = peak_memory_mb(device)
    forward_s = timed(plain_forward, args.repeats)
    forward_peak = peak_memory_mb(device)
    step_s = timed(train_step, args.repeats)
    step_peak = peak_memory_mb(device)
    result = {"base": args.base, "device": device.type, "estimator": args.estimator,
              "dense_weight": args.dense_weight, "warm_start": args.warm_start,
              "streaming_rounds": args.streaming_rounds, "context": args.context,
              "continuation": args.continuation, "forward_s": round(forward_s, 3), "train_step_s": round(step_s, 3),
              "ratio": round(step_s / forward_s, 2), "peak_mb_before": round(before),
              "peak_mb_after_forward": round(forward_peak), "peak_mb_after_train_step": round(step_peak)}
    print(f"plain forward {forward_s:.3f} s | train step {step_s:.3f} s | ratio {step_s / forward_s:.2f}x (target <= 3x)")
    print(f"peak memory MiB: start {before:.0f}, after forward {forward_peak:.0f}, after train step {step_peak:.0f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
