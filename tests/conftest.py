"""Shared test set-up.

TRITON_INTERPRET must be set before Triton is first imported so the kernels
run on CPU tensors in the default suite.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` cleanly when CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: intra-op threads only add synchronisation (slow on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    """The tiny random Llama with SDPA attention (a test module may define its own ``model``)."""
    from curkv_train.models.base import TINY_RANDOM, load_base_model

    return load_base_model(TINY_RANDOM, attn_implementation="sdpa")
