"""Factored cold attention in CurKVCache: installation, the pre-hook's record, equality with the
reconstructing path, and no dense transient of a cold block during a step (tiny random Llama)."""

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DynamicCache

from curkv_train.core.observation import attention_modules
from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import ComputeConfig, CurKVCache, TierConfig, cur
from curkv_train.runtime.allocation import LayerBudget
from curkv_train.runtime.attention import cache_layer_of
from runtime_helpers import TORCH, prompt, random_scorer

WINDOW, N_SINK = 16, 4
COLD = TierConfig(cold=True)


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture
def model():
    """A fresh model per test: installation switches its attention implementation."""
    return load_base_model(TINY_RANDOM, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def scorer():
    return random_scorer(n_sink=N_SINK, window=WINDOW)


def test_caches_share_one_installation_and_the_wrapper(model, scorer):
    first = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=COLD)
    hooks = [dict(module._forward_pre_hooks) for module in attention_modules(model)]
    second = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=COLD)
    assert model.config._attn_implementation == "curkv_factored_sdpa"
    assert [dict(module._forward_pre_hooks) for module in attention_modules(model)] == hooks
    first.close(), second.close()
    model.set_attn_implementation("eager")
    with CurKVCache(scorer, model=model, tiers=COLD) as cache:
        assert cache.factored_attention and model.config._attn_implementation == "curkv_factored_eager"
    assert model.config._attn_implementation == "eager"


def test_hook_records_the_layer_of_a_curkv_cache_only(model, scorer):
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=COLD, compute=TORCH)
    modules = attention_modules(model)
    with torch.no_grad():
        model(prompt(40), past_key_values=cache)
        assert [cache_layer_of(module) for module in modules] == list(cache.layers)
        model(prompt(40), past_key_values=DynamicCache(config=model.config))
    assert all(cache_layer_of(module) is None for module in modules)


def step_pair(model, caches, ids, seen):
    """One forward of ``ids`` through each cache; returns the last-position logits of each."""
    mask = torch.ones(1, seen + ids.shape[-1], dtype=torch.long)
    return [model(ids, past_key_values=cache, attention_mask=mask).logits[:, -1] for cache in caches]


@pytest.mark.parametrize("budget", [None, LayerBudget((0.1, 4.0), 1.0, 0.4)], ids=["uniform", "layer_budget"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_factored_generation_matches_the_reconstructing_path(model, scorer, implementation, budget):
    """Same logits (fp32 tolerance) and the same greedy tokens, decode steps and a 5-token chunk, cold blocks present;
    under a layer budget too (layers of different lengths: the model's mask is fitted to each)."""
    model.set_attn_implementation(implementation)
    caches = [CurKVCache(scorer, model=model, keep_ratio=0.5, layer_budget=budget or "uniform", tiers=COLD,
                         compute=ComputeConfig(backend="torch", factored_attention=factored))
              for factored in (True, False)]
    ids, seen = prompt(500), 0
    chunk = prompt(5, seed=1)
    with torch.no_grad():
        for step in range(2 * WINDOW + 1):
            logits = step_pair(model, caches, ids, seen)
            seen += ids.shape[-1]
            torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
            assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))
            ids = chunk if step == WINDOW else logits[0].argmax(-1, keepdim=True)
            assert caches[0].tier_sizes(1)["cold"] > 0
    assert [caches[0].tier_sizes(layer) for layer in (0, 1)] == [caches[1].tier_sizes(layer) for layer in (0, 1)]
    assert caches[0].nbytes() == caches[1].nbytes()


def test_triton_backend_runs_the_factored_path(model, scorer):
    """backend='auto' (the Triton kernels under TRITON_INTERPRET=1) against the torch reference path."""
    caches = [CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=COLD, compute=ComputeConfig(backend=backend))
              for backend in ("torch", "auto")]
    ids, seen = prompt(500), 0
    with torch.no_grad():
        for _ in range(3):
            logits = step_pair(model, caches, ids, seen)
            seen += ids.shape[-1]
            torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
            ids = logits[0].argmax(-1, keepdim=True)
    assert caches[1].tier_sizes(0)["cold"] > 0


class LargestNewStorage(TorchDispatchMode):
    """Records the bytes of the largest storage any op creates (outputs not sharing an input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("factored", [True, False], ids=["factored", "reconstructing"])
def test_a_decode_step_allocates_no_dense_copy_of_the_cold_blocks(model, scorer, factored, monkeypatch):
    """With factored attention update returns the dense tokens only, nothing rebuilds a cold block, and no
    op of the step allocates as much as one cold K (or V); the reconstructing path does (the control)."""
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, tiers=COLD,
                       compute=ComputeConfig(backend="torch", factored_attention=factored))
    with torch.no_grad():
        token = model(prompt(1000), past_key_values=cache).logits[:, -1:].argmax(-1)
    layer = cache.layers[0]
    assert not layer._compression_due()  # the step measured below only attends
    cold_bytes = sum(cur.reconstruct(block.keys).nbytes for block in layer.cold)
    dense = layer.keys.shape[-2]
    assert cold_bytes > 2 * layer.keys.nbytes  # a cold K outweighs the dense K the step copies when appending
    returned = []
    update = type(layer).update
    monkeypatch.setattr(type(layer), "update", lambda self, *a, **kw: returned.append(update(self, *a, **kw))
                        or returned[-1])
    if factored:
        monkeypatch.setattr(cur, "reconstruct", lambda factors: pytest.fail("a cold block was rebuilt"))
    with torch.no_grad(), LargestNewStorage() as probe:
        model(token, past_key_values=cache, attention_mask=torch.ones(1, 1001, dtype=torch.long))
    lengths = {keys.shape[-2] for keys, _ in returned}
    if factored:
        assert lengths == {dense + 1}
        assert probe.largest < cold_bytes
    else:
        assert lengths == {layer.cold_tokens + dense + 1}
        assert probe.largest >= cold_bytes


def test_flex_attention_with_a_layer_budget_is_one_error_and_runs_with_one_ratio(scorer):
    """flex_attention's one block mask, sized for layer 0, failed in the first layer holding another count."""
    from transformers import LlamaForCausalLM

    from curkv_train.core.errors import CurKVError
    from curkv_train.models.base import tiny_llama_config

    config = tiny_llama_config()
    config._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(CurKVError, match="builds one block mask for layer 0's length"):
        CurKVCache(scorer, model=model, keep_ratio=0.5, layer_budget=LayerBudget((1.0, 5.0)), compute=TORCH)
    cache = CurKVCache(scorer, model=model, keep_ratio=0.5, layer_budget="uniform", compute=TORCH)
    if "kvpress" in sys.modules:  # importing kvpress patches transformers' attention functions: flex then fails alone
        return
    with torch.no_grad():
        logits = model(torch.randint(3, 512, (1, 150)), past_key_values=cache).logits
        model(logits[:, -1:].argmax(dim=-1), past_key_values=cache)
    assert cache.get_seq_length() == 151
