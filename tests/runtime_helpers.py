"""Shared pieces of the runtime tests: random scorers for the tiny Llama."""

import torch

from curkv_train.models.seed_estimator import ValueEstimator
from curkv_train.runtime import ComputeConfig, Scorer

TORCH = ComputeConfig(backend="torch")  # the plain-PyTorch kernels: what most runtime tests compare against


def random_scorer(n_sink: int = 4, window: int = 16, bias: float | None = None) -> Scorer:
    """A scorer for the tiny Llama (2 layers, 2 KV heads, head_dim 16) with random key/position weights."""
    torch.manual_seed(0)
    estimator = ValueEstimator(2, 2, 16, max_positions=2048)
    with torch.no_grad():
        estimator.key_weight.normal_()
        estimator.position_weight.normal_()
        if bias is not None:
            estimator.bias.fill_(bias)
    return Scorer(estimator, n_sink=n_sink, window=window)


def family_scorer(family: str, key_view: str = "pre_rope", n_sink: int = 4, window: int = 16, num_layers: int = 2,
                  **options) -> Scorer:
    """A scorer of ``family`` for the tiny Llama (``num_layers`` deep) whose every term is random (no term is
    silently zero); ``options``: the family's other constructor arguments."""
    from curkv_train.core.shapes import KVShape
    from curkv_train.models.families import build_estimator

    torch.manual_seed(1)
    shape = KVShape(num_layers=num_layers, num_kv_heads=2, head_dim=16, num_attention_heads=4, max_positions=2048,
                    hidden_size=64)
    options = {"observation_window": 8, **options} if family == "query_aware" else options
    estimator = build_estimator(family, shape, **options)
    with torch.no_grad():
        for parameter in estimator.parameters():
            parameter.normal_()
    return Scorer(estimator.eval(), key_view=key_view, n_sink=n_sink, window=window)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    """(1, length) random token ids of the tiny Llama's vocabulary, seeded."""
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids: torch.Tensor, cache=None, new: int = 40) -> torch.Tensor:
    """``new`` greedy tokens after ``ids`` (1, tokens) through ``cache`` (None: the model's own), no EOS stop."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          past_key_values=cache, pad_token_id=0, eos_token_id=None)
