"""Shared pieces of the runtime tests: a single-threaded torch and a random scorer for the tiny Llama."""

import contextlib

import torch

from curkv_train.models.estimator import ValueEstimator
from curkv_train.runtime import Scorer


@contextlib.contextmanager
def single_threaded():
    """Tiny tensors: intra-op threads only add synchronisation (slow on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
