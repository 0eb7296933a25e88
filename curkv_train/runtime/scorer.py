"""A trained estimator packaged for inference: scores one layer's cached tokens, whatever its family."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.features import check_matmul_precision, feature_backend, future_rotation, output_gram
from curkv_train.core.observation import (Observation, QueryStatistics, attention_module, observe_queries,
                                          pre_rope_queries)
from curkv_train.core.rope import key_view
from curkv_train.core.selection import check_allocation, check_head_floor
from curkv_train.core.errors import CurKVError
from curkv_train.models.seed_estimator import EstimatorInputs
from curkv_train.runtime.allocation import LayerBudget


@dataclass
class Scorer:
    """An estimator (any family of :mod:`curkv_train.models.families`) with the settings it was trained under.

    Attributes:
        estimator: the trained network.
        key_view: pre_rope, end_relative or post_rope (how keys are presented to it).
        n_sink, window: the always-kept spans it was trained with.
        metadata: everything else recorded at export (fingerprint, recipe, metrics).
        keep_ratio: the keep ratio ρ of its last training step; the middle of the keep ratios of a last
            stage that drew a compression ratio per step or cycled a list of them (scorer.json's
            training.last_stage has the range or list).
        temperature: the score temperature T of its last training stage (s = σ(z / T)).
        layer_budget: how CurKVCache splits a keep ratio across layers (``curkv-train calibrate``),
            or None for one ratio everywhere.
        allocation: ``per_head`` or ``joint``, where its training's hard steps put the kept places (the
            runtime cache's default, ``TierConfig.allocation``); ``head_floor``: the joint allocation's per-head floor.
        matmul_precision: ``highest`` (as trained) or ``medium``: the query features' attention-sized
            products from bfloat16 operands (:func:`~curkv_train.core.features.product`), faster on a CPU
            with bf16 instructions at a small cost in agreement (docs/runtime.md). Other families ignore it.
        bucketed: pad every scored width to :func:`bucket_width` (the padding masked): what :meth:`graphed` scores
            through, so a graph serves a bucket of lengths.
    """

    estimator: nn.Module
    key_view: str = "pre_rope"
    n_sink: int = 4
    window: int = 64
    metadata: dict = field(default_factory=dict)
    keep_ratio: float = 0.5
    temperature: float = 1.0
    layer_budget: LayerBudget | None = None
    allocation: str = "per_head"
    head_floor: float = 0.1
    matmul_precision: str = "highest"
    bucketed: bool = False

    def __post_init__(self) -> None:
        check_matmul_precision(self.matmul_precision)
        check_allocation(self.allocation)
        check_head_floor(self.head_floor)

    @property
    def family(self) -> str:
        """The estimator family: seed, query_aware or hidden."""
        return self.estimator.family

    @property
    def base_model_id(self) -> str | None:
        """The base model's hub id or folder the scorer records (``metadata["base_model"]``: an id, or a dict with
        ``id`` and ``fingerprint``), or None."""
        base = self.metadata.get("base_model")
        return (base.get("id") if isinstance(base, dict) else base) or None

    @property
    def base_fallback(self) -> str | None:
        """Where its training loaded the base model from when the hub was unreachable (its run's
        ``base_fallback``, e.g. ``embedded:smollm2-135m-instruct``), or None."""
        training = self.metadata.get("training") or {}
        return (training.get("hyper_parameters") or {}).get("base_fallback")

    @property
    def observation_window(self) -> int:
        """Tokens of recent hidden states the scorer reads (0 for families that read none)."""
        return getattr(self.estimator, "observation_window", 0) if "query_features" in self.estimator.needs else 0

    @property
    def scores_on_arrival(self) -> bool:
        """Whether each token's logit is computed once from its hidden state (the ``hidden`` family)."""
        return "token_scores" in self.estimator.needs

    @torch.no_grad()
    def token_scores(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """Per-token logits (batch, kv_heads, tokens) of arriving tokens' attention inputs (batch, tokens, hidden)."""
        self._follow(hidden.device)
        return self.estimator.token_scores(hidden[None], layers=layer_index(layer, hidden.device))[0]

    def _follow(self, device: torch.device) -> None:
        """Move the estimator to ``device`` if it is elsewhere (``Module.to`` walks every parameter: at every layer
        of every compression that walk cost as much as a scoring operator)."""
        if next(self.estimator.parameters()).device != device:
            self.estimator.to(device)

    def prefill_inputs(self, model: PreTrainedModel, layer: int, hidden_states: torch.Tensor) -> dict:
        """What this scorer reads besides K/V, from a prefill's attention inputs (batch, tokens, hidden_size)
        at positions 0, 1, ...: :meth:`score_layer`'s ``observation`` and/or ``token_scores`` keywords."""
        extra = {}
        if self.observation_window:
            queries = pre_rope_queries(attention_module(model, layer), hidden_states)
            extra["observation"] = observe_queries(queries, self.estimator.statistics_skip)
        if self.scores_on_arrival:
            extra["token_scores"] = self.token_scores(layer, hidden_states)
        return extra

    @torch.no_grad()
    def score_layer(self, model: PreTrainedModel, layer: int, keys: torch.Tensor, values: torch.Tensor,
                    positions: torch.Tensor | None = None, end: int | None = None,
                    observation: Observation | None = None, token_scores: torch.Tensor | None = None,
                    projected_keys: torch.Tensor | None = None, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Keep logits of one layer's cached tokens.

        Args:
            model: the base model (rotary tables; attention projections for query features).
            layer: decoder layer index.
            keys: (batch, kv_heads, tokens, head_dim) cached keys, post-RoPE as transformers caches them.
            values: (batch, kv_heads, tokens, head_dim) cached values.
            positions: (tokens,) absolute positions of the cached tokens, default 0..tokens-1; or
                (batch, kv_heads, tokens) when each head holds its own tokens (a compressed cache).
            end: tokens seen so far (distance features are measured to it); default last position + 1.
            observation: the layer's observation window (``query_aware`` family).
            token_scores: (batch, kv_heads, tokens) logits stored when the tokens arrived (``hidden`` family).
            projected_keys: (batch, kv_heads, tokens, head_dim) the same keys before RoPE, as the model projected
                them, if the caller has them (a prefill): the ``pre_rope`` key view without turning the cached
                keys back (equal up to rounding). A compiled scorer turns them back itself (one graph).
            valid: (batch, kv_heads, tokens) bool, False for padding after each head's tokens (heads of different
                lengths scored together; ``positions`` per head, a real token's where padded): the real tokens'
                logits are those of scoring each head alone (:func:`~curkv_train.core.features.query_features`).

        Returns:
            (batch, kv_heads, tokens) float32 logits, higher = keep (meaningless where ``valid`` is False).
        """
        tokens = keys.shape[2]
        if positions is None:
            positions = torch.arange(tokens, device=keys.device)
        if end is None:
            end = int(positions.max()) + 1
        if self.bucketed:
            keys, values, positions, token_scores, valid = padded_to_bucket(keys, values, positions, token_scores,
                                                                            valid)
            projected_keys = None
        self._check_inputs(layer, observation, token_scores)
        self._follow(keys.device)
        module = attention_module(model, layer)
        gram = rotation = None
        if "query_features" in self.estimator.needs:  # looked up here, outside what compiled() compiles
            gram = output_gram(module, keys.shape[1], observation.queries.shape[1] // keys.shape[1])
            rotation = future_rotation(model, end, self.estimator.future_positions, keys.shape[-1], keys)
        # eager, a slice: the parameters' rows as views; compiled, a tensor input (a slice's constants would
        # compile a graph per layer), and positions always per head (shared ones would compile a second graph)
        layers = layer_index(layer, keys.device) if self.is_compiled else slice(layer, layer + 1)
        if self.is_compiled and positions.dim() == 1:
            positions = positions.expand(*keys.shape[:2], -1).contiguous()
        viewed = projected_keys.float() if projected_keys is not None and self.key_view == "pre_rope" \
            and not self.is_compiled else None
        if not self.bucketed:
            return self.layer_logits(model, module, layers, keys, values, positions, end,
                                     observation, token_scores, gram, rotation, viewed, valid)
        if self.is_compiled:  # the length a tensor: an int input would record a CUDA graph per value
            end = torch.tensor(end, device=keys.device)
            torch.compiler.cudagraph_mark_step_begin()  # the last replay's outputs were copied out: overwrite them
        logits = self.layer_logits(model, module, layers, keys, values, positions, end, observation, token_scores,
                                   gram, rotation, viewed, valid)
        return logits[..., :tokens].clone()  # a copy: the graph's next replay writes over its output

    def _check_inputs(self, layer: int, observation: Observation | None, token_scores: torch.Tensor | None) -> None:
        """A one-line CurKVError if layer ``layer`` lacks what this scorer's family reads besides K and V."""
        if "query_features" in self.estimator.needs and observation is None:
            raise CurKVError(f"a {self.family} scorer needs the observation window (the last "
                             f"{self.observation_window} hidden states of layer {layer}); none was recorded")
        if self.scores_on_arrival and token_scores is None:
            raise CurKVError(f"a {self.family} scorer needs each token's stored score (from its hidden state) for "
                             f"layer {layer}; none was recorded")

    def batches_layers(self, keys: torch.Tensor) -> bool:
        """Whether :meth:`score_layers` scores several layers holding keys like ``keys`` in one pass: an eager
        scorer whose inputs hold no per-layer weights (the ‖W_O v‖ feature's, which the fused kernels of a CUDA
        device also read)."""
        if self.is_compiled:
            return False
        if "query_features" not in self.estimator.needs:
            return True
        return "output_norm" not in self.estimator.features and feature_backend("auto", keys, keys) == "torch"

    @torch.no_grad()
    def score_layers(self, model: PreTrainedModel, layers: list[int], keys: list[torch.Tensor],
                     values: list[torch.Tensor], observations: list[Observation | None],
                     token_scores: list[torch.Tensor | None],
                     projected_keys: list[torch.Tensor | None]) -> list[torch.Tensor]:
        """Keep logits of several layers, each holding a prefill's first tokens (positions 0 .. tokens − 1): what
        :meth:`score_layer` gives each, from one pass with the layers stacked along the batch of every operator
        where :meth:`batches_layers` (layer by layer, a pass is tens of small operators, each costing as much as
        its work on 1K tokens), else layer by layer. Arguments are per layer, as :meth:`score_layer`'s.

        Returns:
            (batch, kv_heads, tokens) float32 logits per layer.
        """
        modules = [attention_module(model, layer) for layer in layers]
        if not self.batches_layers(keys[0]) or len({getattr(module, "scaling", None) for module in modules}) > 1:
            return [self.score_layer(model, *inputs) for inputs in
                    zip(layers, keys, values, [None] * len(layers), [None] * len(layers), observations, token_scores,
                        projected_keys)]
        for layer, observation, scores in zip(layers, observations, token_scores):
            self._check_inputs(layer, observation, scores)
        self._follow(keys[0].device)
        end = keys[0].shape[2]
        observation = None if observations[0] is None else Observation(
            torch.cat([each.queries for each in observations]), observations[0].positions,
            QueryStatistics.stacked([each.statistics for each in observations]))
        rotation = None
        if "query_features" in self.estimator.needs:
            rotation = future_rotation(model, end, self.estimator.future_positions, keys[0].shape[-1], keys[0])
        viewed = None
        if self.key_view == "pre_rope" and all(each is not None for each in projected_keys):
            viewed = torch.cat(projected_keys).float()
        consecutive = layers == list(range(layers[0], layers[-1] + 1))
        rows = slice(layers[0], layers[-1] + 1) if consecutive else torch.tensor(layers, device=keys[0].device)
        logits = self.layer_logits(model, modules[0], rows, torch.cat(keys), torch.cat(values),
                                   torch.arange(end, device=keys[0].device), end, observation,
                                   None if token_scores[0] is None else torch.cat(token_scores), None, rotation, viewed)
        return list(logits.view(len(layers), -1, *logits.shape[1:]).unbind(0))

    def layer_logits(self, model: PreTrainedModel, module: nn.Module, layers: torch.Tensor | slice,
                     keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, end: int,
                     observation: Observation | None,
                     token_scores: torch.Tensor | None, gram: torch.Tensor | None = None,
                     rotation: torch.Tensor | None = None, viewed_keys: torch.Tensor | None = None,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor work of :meth:`score_layer` (features, key view, estimator) for the layer whose attention
        module is ``module`` and index ``layers`` (a (1,) tensor, or a slice of one layer): what :meth:`compiled`
        compiles, in one graph when the layer's :func:`~curkv_train.core.features.output_gram` and the round's
        :func:`~curkv_train.core.features.future_rotation` come in as ``gram`` and ``rotation``; ``viewed_keys``: the keys
        in the scorer's key view if the caller has them; ``valid`` as :meth:`score_layer`'s. Returns (batch, kv_heads,
        tokens) float32 logits.

        ``layers`` may also pick L' layers (:meth:`score_layers`) whose inputs are stacked along the batch, layer i's
        batch rows first: their logits come back stacked the same way, (L'·batch, kv_heads, tokens)."""
        count = layers.stop - layers.start if isinstance(layers, slice) else layers.numel()

        def per_layer(tensor: torch.Tensor) -> torch.Tensor:  # (L'·batch, ...) -> (L', batch, ...)
            return tensor.view(count, -1, *tensor.shape[1:])

        features = None
        if "query_features" in self.estimator.needs:
            features = per_layer(self.estimator.query_features(model, module, keys, values, positions, end, observation,
                                                               gram, rotation, self.matmul_precision, valid))
        if viewed_keys is None:
            viewed_keys = key_view(model, keys, positions, self.key_view, end)
        inputs = EstimatorInputs(per_layer(viewed_keys), per_layer(values.float()), positions, end,
                                 query_features=features,
                                 token_scores=None if token_scores is None else per_layer(token_scores))
        return self.estimator(inputs, layers=layers).flatten(0, 1)

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`layer_logits` runs through ``torch.compile`` (a copy made by :meth:`compiled`)."""
        return "layer_logits" in vars(self)

    def compiled(self) -> "Scorer":
        """A copy of this scorer (sharing its estimator) whose :meth:`layer_logits` runs through
        ``torch.compile`` with dynamic shapes: one graph serves every layer and length (the attention
        module and layer index are inputs, not constants), compiled on the first call.

        Scoring is some hundreds of small operators per layer, so where launches dominate (a GPU,
        short contexts) fusing them is most of its cost; the first call pays the compilation.
        """
        copy = replace(self)
        copy.layer_logits = torch.compile(copy.layer_logits, dynamic=True)
        return copy

    def graphed(self) -> "Scorer":
        """A copy of this scorer (sharing its estimator) that scores through ``torch.compile``'s ``reduce-overhead``
        mode: on a GPU each scoring is the replay of a CUDA graph, one launch for its hundreds of operators. A graph
        is recorded for every distinct set of integer inputs, so the widths are padded to :func:`bucket_width` (four
        per doubling of the held tokens, at most a quarter of them padding) and the length comes in as a tensor: a
        decode that re-compresses every interval replays a few graphs rather than recording one per compression.
        One compilation, as :meth:`compiled`; on a CPU the same fused kernels without graphs."""
        copy = replace(self, bucketed=True)
        copy.layer_logits = torch.compile(copy.layer_logits, dynamic=True, mode="reduce-overhead")
        return copy


def bucket_width(tokens: int) -> int:
    """The width a bucketed scorer pads ``tokens`` to: at least 64, else the next multiple of a quarter of the
    largest power of two not above ``tokens`` (four widths per doubling; the padding is under a quarter)."""
    if tokens <= 64:
        return 64
    step = 1 << (tokens.bit_length() - 3)
    return -(-tokens // step) * step


def padded_to_bucket(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                     token_scores: torch.Tensor | None, valid: torch.Tensor | None) -> tuple:
    """Keys, values (batch, kv_heads, tokens, head_dim), per-head positions, stored scores and the ``valid`` mask
    (batch, kv_heads, tokens) widened to :func:`bucket_width`: the padding repeats the last token, masked."""
    batch, heads, tokens = keys.shape[:3]
    width = bucket_width(tokens)
    positions = positions.expand(batch, heads, tokens)
    if valid is None:
        valid = torch.ones(batch, heads, tokens, dtype=torch.bool, device=keys.device)
    index = torch.arange(width, device=keys.device).clamp_max(tokens - 1)
    pad = torch.zeros(batch, heads, width - tokens, dtype=torch.bool, device=keys.device)
    scores = None if token_scores is None else token_scores.index_select(2, index)
    return (keys.index_select(2, index), values.index_select(2, index), positions.index_select(2, index), scores,
            torch.cat([valid, pad], dim=2))


def layer_index(layer: int, device: torch.device) -> torch.Tensor:
    """(1,) the estimator's index tensor for ``layer``, made on ``device`` (a copy from the host would wait for it)."""
    return torch.arange(layer, layer + 1, device=device)
