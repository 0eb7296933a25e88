"""CurKVCache on a GPU: what it does on the CPU, with every tensor on the device (skipped without CUDA).

Runs the tiny random Llama: the runtime's device handling (rotary tables, positions, the observation
buffers, the Triton compaction and factored-attention kernels) is what is under test, not speed.
"""

import pytest
import torch
from transformers import DynamicCache

from curkv_train.models.base import TINY_RANDOM, load_base_model
from curkv_train.runtime import ComputeConfig, CurKVCache, TierConfig
from curkv_train.runtime.layer import CurKVLayer
from runtime_helpers import family_scorer

pytestmark = pytest.mark.gpu

FAMILIES = ["seed", "query_aware", "hidden"]


@pytest.fixture(scope="module")
def models():
    """The tiny Llama on the CPU and on the GPU (the same weights)."""
    cpu = load_base_model(TINY_RANDOM, attn_implementation="sdpa")
    return {"cpu": cpu, "cuda": load_base_model(TINY_RANDOM, attn_implementation="sdpa").to("cuda")}


def prompt(length: int, device: str) -> torch.Tensor:
    return torch.randint(3, 512, (1, length), generator=torch.Generator().manual_seed(0)).to(device)


def greedy(model, ids: torch.Tensor, cache, new: int = 24) -> torch.Tensor:
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          past_key_values=cache, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_one_generates_what_the_full_cache_generates(models, family):
    model, ids = models["cuda"], prompt(200, "cuda")
    full = greedy(model, ids, DynamicCache(config=model.config))
    assert torch.equal(greedy(model, ids, CurKVCache(family_scorer(family), model=model, keep_ratio=1.0)), full)


@pytest.mark.parametrize("family", FAMILIES)
def test_half_keep_selects_what_the_cpu_selects(models, family):
    held = {}
    for device, model in models.items():
        cache = CurKVCache(family_scorer(family), model=model, keep_ratio=0.5, layer_budget="uniform")
        with torch.no_grad():
            model(prompt(300, device), past_key_values=cache)
        layer = cache.layers[-1]
        assert layer.keys.device.type == layer.positions.device.type == device
        held[device] = layer.positions.long().cpu()
    assert held["cuda"].shape == held["cpu"].shape
    agreement = (held["cuda"][..., :, None] == held["cpu"][..., None, :]).any(-1).float().mean()
    assert agreement > 0.97, f"GPU and CPU keep different tokens: {agreement:.3f} of the kept positions agree"


@torch.no_grad()
def test_cold_tier_through_the_triton_kernels_matches_torch(models):
    model, ids, tail = models["cuda"], prompt(400, "cuda"), prompt(8, "cuda")
    logits = {}
    for backend in ("torch", "triton"):
        cache = CurKVCache(family_scorer("seed"), model=model, keep_ratio=0.5,
                           tiers=TierConfig(cold=True, warm_windows=2), compute=ComputeConfig(backend=backend))
        model(ids, past_key_values=cache)
        assert cache.layers[0].cold, "the prompt should leave a cold block"
        logits[backend] = torch.cat([model(tail[:, i : i + 1], past_key_values=cache).logits for i in range(8)], 1)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-3, rtol=1e-3)


@torch.no_grad()
def test_a_compiled_scorer_keeps_what_the_eager_one_keeps(models, monkeypatch):
    from curkv_train.core import features

    # compiled scoring runs the features' torch path; eager would take the fused kernels, equal only to float error
    monkeypatch.setattr(features, "feature_backend", lambda *args: "torch")
    model, held = models["cuda"], []
    for compile_scorer in (False, True):
        cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5,
                           compute=ComputeConfig(compile_scorer=compile_scorer))
        model(prompt(300, "cuda"), past_key_values=cache)
        held.append(torch.stack([layer.positions.long() for layer in cache.layers]))
    assert torch.equal(held[1], held[0])


@torch.no_grad()
def test_the_fused_feature_kernels_keep_what_the_torch_path_keeps(models, monkeypatch):
    from curkv_train.core import features

    model, held, choose = models["cuda"], [], features.feature_backend
    for backend in ("triton", "torch"):
        monkeypatch.setattr(features, "feature_backend", lambda *args, _backend=backend: _backend)
        cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5)
        model(prompt(300, "cuda"), past_key_values=cache)
        held.append(torch.stack([layer.positions.long() for layer in cache.layers]))
    assert choose("auto", cache.layers[0].keys, cache.layers[0].values) == "triton"  # what eager scoring takes
    agreement = (held[0][..., :, None] == held[1][..., None, :]).any(-1).float().mean()
    assert agreement > 0.99, f"the kernels and the torch path keep different tokens: {agreement:.3f} agree"


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_a_compression_never_waits_for_the_device(models, family, monkeypatch):
    """Scoring, selecting and compacting a layer queue work on the GPU without reading anything back
    (a read-back stalls the host until the device catches up, once per layer and compression)."""
    compressed, compress = [], CurKVLayer.compress

    def strict(layer: CurKVLayer) -> None:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            compress(layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        compressed.append(layer.layer_idx)

    monkeypatch.setattr(CurKVLayer, "compress", strict)
    model = models["cuda"]
    model(prompt(300, "cuda"), past_key_values=CurKVCache(family_scorer(family), model=model, keep_ratio=0.5))
    assert compressed == list(range(model.config.num_hidden_layers))


def test_a_prefill_observation_never_waits_for_the_device():
    """What CurKVPress and training capture build per layer (observe_queries) reads nothing back from the GPU."""
    from curkv_train.core.observation import observe_queries

    queries = torch.randn(1, 4, 300, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        observation = observe_queries(queries, 4)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert observation.statistics.count == 296


def test_scoring_through_cuda_graphs_generates_what_eager_scoring_does(models):
    """ComputeConfig(scoring_graphs=True) on the device: every compression, the decode's included, replays a CUDA
    graph of one of a few bucketed widths; the tokens are the eager cache's."""
    from curkv_train.runtime.scorer import bucket_width

    model, ids = models["cuda"], prompt(300, "cuda")
    tokens, widths = [], []
    for graphs in (False, True):
        cache = CurKVCache(family_scorer("query_aware"), model=model, keep_ratio=0.5,
                           tiers=TierConfig(allocation="joint"), compute=ComputeConfig(scoring_graphs=graphs))
        if graphs:
            graphed = cache.scorer.layer_logits

            def spy(model, module, layers, keys, *rest):
                widths.append(keys.shape[2])
                return graphed(model, module, layers, keys, *rest)

            cache.scorer.layer_logits = spy
        tokens.append(greedy(model, ids, cache, new=160))
    assert torch.equal(tokens[1], tokens[0])
    assert len(widths) > 4 and all(width == bucket_width(width) for width in widths)
    assert len(set(widths)) < len(widths)  # graphs replayed, not one recorded per compression
