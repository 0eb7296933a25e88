"""Trainer flags that let GPU recipes (Llama-2, FSDP/DDP) be instantiated on a CPU-only machine."""

import torch

# The Llama-2 recipes ask for GPUs; to instantiate them here, the hardware flags are swapped for CPU ones.
ON_CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.num_nodes=1", "--trainer.strategy=auto",
          "--trainer.plugins=null"]


def hardware_flags() -> list[str]:
    """``ON_CPU`` without CUDA, nothing with it (then recipes are built as written)."""
    return [] if torch.cuda.is_available() else ON_CPU
