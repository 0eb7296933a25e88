"""Scorer.compiled(): the eager scorer's logits through torch.compile, one graph for every layer and length."""

import dataclasses
import shutil

import pytest
import torch
import torch._dynamo

from curkv_train.runtime import ComputeConfig, CurKVCache
from runtime_helpers import family_scorer, greedy

pytestmark = [
    pytest.mark.integration,  # compiling takes tens of seconds on a CPU
    pytest.mark.skipif(not any(shutil.which(name) for name in ("g++", "c++", "clang++")),
                       reason="torch.compile on a CPU needs a C++ compiler"),
]


def layer_inputs(scorer, model, layer: int, tokens: int, seed: int) -> dict:
    """Random post-RoPE keys, values and per-head positions of one layer, with the observation of random
    hidden states (what CurKVCache hands the scorer at a compression)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, 2, tokens, 16, generator=generator) for _ in range(2))
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=generator)
    positions = torch.arange(tokens).expand(1, 2, tokens).contiguous()
    observation = scorer.prefill_inputs(model, layer, hidden)["observation"]
    return {"keys": keys, "values": values, "positions": positions, "end": tokens, "observation": observation}


@torch.no_grad()
def test_compiled_logits_equal_the_eager_ones_in_one_graph_for_every_layer_and_length(model):
    scorer = family_scorer("query_aware")
    compiled = scorer.compiled()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled.score_layer(model, 0, **layer_inputs(scorer, model, 0, 40, seed=0))  # compiles
    assert counters["stats"]["unique_graphs"] == 1  # nothing the graph calls is left to eager (no graph break)
    assert not counters["graph_break"]
    for layer, tokens in [(0, 57), (1, 40), (1, 93)]:
        inputs = layer_inputs(scorer, model, layer, tokens, seed=tokens)
        torch.testing.assert_close(compiled.score_layer(model, layer, **inputs),
                                   scorer.score_layer(model, layer, **inputs), atol=1e-4, rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1  # no compilation per layer or length


def test_a_cache_with_a_compiled_scorer_generates_what_the_eager_one_does(model):
    prompt = torch.randint(3, 512, (1, 200), generator=torch.Generator().manual_seed(0))
    tokens, compressions = [], []
    for compile_scorer in (False, True):
        cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5,
                           compute=ComputeConfig(compile_scorer=compile_scorer))
        original = cache.scorer.score_layer

        def spy(model, layer, keys, values, positions, _original=original, **rest):
            if layer == 0:  # the positions CurKVCache._score hands the scorer
                compressions.append(positions.dim())
            return _original(model, layer, keys, values, positions, **rest)

        cache.scorer.score_layer = spy
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        tokens.append(greedy(model, prompt, cache, new=40))
    assert torch.equal(tokens[1], tokens[0])
    # the prefill's compression scores shared positions, the later ones each head's own: still one graph
    assert compressions[:2] == [1, 3] and len(compressions) > 2
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@torch.no_grad()
def test_compiled_medium_precision_logits_equal_the_eager_medium_ones(model):
    scorer = dataclasses.replace(family_scorer("query_aware"), matmul_precision="medium")
    inputs = layer_inputs(scorer, model, 1, 64, seed=3)
    eager = scorer.score_layer(model, 1, **inputs)
    assert not torch.equal(eager, dataclasses.replace(scorer, matmul_precision="highest").score_layer(model, 1, **inputs))
    torch.testing.assert_close(scorer.compiled().score_layer(model, 1, **inputs), eager, atol=1e-4, rtol=1e-4)


def test_a_cache_scoring_through_graphs_generates_what_the_eager_one_does(model):
    """ComputeConfig(scoring_graphs=True): torch.compile's reduce-overhead mode (CUDA graphs on a GPU; on a CPU the
    same compiled kernels), every width a bucket and the length a tensor, so no integer input changes from one
    compression to the next but the bucket: one compilation, the eager cache's tokens."""
    from curkv_train.runtime.scorer import bucket_width

    prompt = torch.randint(3, 512, (1, 200), generator=torch.Generator().manual_seed(0))
    tokens, inputs = [], []
    for graphs in (False, True):
        cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5,
                           compute=ComputeConfig(scoring_graphs=graphs))
        if graphs:
            compiled = cache.scorer.layer_logits

            def spy(model, module, layers, keys, values, positions, end, *rest):
                inputs.append((keys.shape[2], isinstance(end, torch.Tensor)))
                return compiled(model, module, layers, keys, values, positions, end, *rest)

            cache.scorer.layer_logits = spy
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        tokens.append(greedy(model, prompt, cache, new=40))
    assert torch.equal(tokens[1], tokens[0])
    assert len(inputs) > 2 and all(is_tensor and width == bucket_width(width) for width, is_tensor in inputs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
