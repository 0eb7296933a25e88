"""The ``query_aware`` family: the seed's terms plus what the context's own queries say about each token.

    z_j = seed_terms_j + w_{l,h}·f_j + mlp_{l,h}(f_j)

with f_j the :data:`~curkv_train.core.features.QUERY_FEATURES` of token j (window attention,
expected attention, log ‖v‖, log ‖W_O v‖, each centred per head), or the subset that the option
``features`` names. Initialised so that before training it ranks exactly like a training-free rule
(``init_rule``): the seed terms' weights and the MLP's output start at zero and w is that rule's
combination; training learns the residual.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import PreTrainedModel

from curkv_train.core.features import QUERY_FEATURES, check_feature_names, query_features
from curkv_train.core.observation import Observation
from curkv_train.core.errors import CurKVError
from curkv_train.models.seed_estimator import EstimatorInputs, ValueEstimator, add_per_head_dot_, per_head_affine

# rule -> weights on QUERY_FEATURES (log scores, so a sum is a product of the rule's factors)
INIT_RULES = {
    "expected_attention": {"expected_attention": 1.0, "value_norm": 1.0},  # ExpectedAttention × ‖v‖
    "snapkv": {"window_attention": 1.0},
    "critical": {"expected_attention": 1.0, "output_norm": 1.0},  # expected attention × ‖W_O v‖
}


class QueryAwareEstimator(ValueEstimator):
    """Seed terms plus a learned per-(layer, KV head) function of the query features.

    Args:
        num_layers, num_kv_heads, head_dim, hidden_divisor, max_positions, init_keep: as the seed.
        observation_window: W, the last W tokens whose queries the window-attention feature reads.
        statistics_skip: the expected-attention statistics leave out the queries of the first
            ``statistics_skip`` tokens (attention-sink outliers), as ExpectedAttention does.
        future_positions: positions after the end the expected-attention rotation averages over.
        pool_kernel: odd pooling width of the window-attention feature.
        feature_hidden: width of the residual MLP over the features.
        init_rule: the training-free rule it ranks like before training (a key of INIT_RULES).
        features: the query features it reads, a subset of QUERY_FEATURES in its order (default all
            four); fewer features score faster (the window attention is most of the cost) and must
            include the ones ``init_rule`` weighs.
    """

    family = "query_aware"
    needs = frozenset({"query_features"})

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, hidden_divisor: int = 4,
                 max_positions: int = 8192, init_keep: float = 0.5, observation_window: int = 64,
                 statistics_skip: int = 4, future_positions: int = 512, pool_kernel: int = 5, feature_hidden: int = 8,
                 init_rule: str = "expected_attention",
                 features: tuple[str, ...] | list[str] = QUERY_FEATURES) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, hidden_divisor, max_positions, init_keep)
        if init_rule not in INIT_RULES:
            raise ValueError(f"unknown init_rule {init_rule!r}; expected one of {', '.join(INIT_RULES)}")
        if observation_window < 1 or pool_kernel < 1 or pool_kernel % 2 == 0:
            raise ValueError(f"need observation_window >= 1 and an odd pool_kernel, got {observation_window}, "
                             f"{pool_kernel}")
        self.observation_window, self.statistics_skip = observation_window, statistics_skip
        self.future_positions, self.pool_kernel = future_positions, pool_kernel
        check_feature_names(features)
        missing = [name for name in INIT_RULES[init_rule] if name not in features]
        if missing:
            raise CurKVError(f"init_rule {init_rule!r} weighs the query features {missing}, which features leaves out")
        self.feature_hidden, self.init_rule, self.features = feature_hidden, init_rule, tuple(features)
        shape, count = (num_layers, num_kv_heads), len(self.features)
        rule = torch.tensor([INIT_RULES[init_rule].get(name, 0.0) for name in self.features])
        self.feature_weight = nn.Parameter(rule.expand(*shape, count).clone())
        self.feature_in = nn.Parameter(torch.randn(*shape, count, feature_hidden) / math.sqrt(count))
        self.feature_in_bias = nn.Parameter(torch.zeros(*shape, feature_hidden))
        self.feature_out = nn.Parameter(torch.zeros(*shape, feature_hidden))
        with torch.no_grad():
            self.value_out.zero_()

    def config(self) -> dict:
        """Constructor arguments, enough to rebuild this estimator."""
        return {**super().config(), "observation_window": self.observation_window,
                "statistics_skip": self.statistics_skip, "future_positions": self.future_positions, "pool_kernel": self.pool_kernel,
                "feature_hidden": self.feature_hidden, "init_rule": self.init_rule, "features": list(self.features)}

    def activation_floats(self) -> int:
        """float32 values kept for the backward per (layer, KV head, token): the seed's, features, feature MLP."""
        return super().activation_floats() + len(self.features) + self.feature_hidden

    def query_features(self, model: PreTrainedModel, module: nn.Module, keys: torch.Tensor, values: torch.Tensor,
                       positions: torch.Tensor, end: int, observation: Observation,
                       gram: torch.Tensor | None = None, rotation: torch.Tensor | None = None,
                       matmul_precision: str = "highest", valid: torch.Tensor | None = None) -> torch.Tensor:
        """This estimator's features of one layer (``module``: its attention module), (batch, kv_heads, tokens, F):
        :func:`query_features` with its features, observation window, future positions and pooling (training,
        cache and press all call this); ``gram``, ``rotation``, ``matmul_precision`` and ``valid`` as there."""
        return query_features(model, module, keys, values, positions, end, observation.last(self.observation_window),
                              future_positions=self.future_positions, pool_kernel=self.pool_kernel, gram=gram,
                              rotation=rotation, matmul_precision=matmul_precision, names=self.features, valid=valid)

    def forward(self, inputs: EstimatorInputs, layers: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Keep-score logits (L', batch, kv_heads, tokens) float32; needs ``inputs.query_features``."""
        features = inputs.query_features
        if features is None:
            raise ValueError("the query_aware estimator needs query_features (see curkv_train.core.features)")
        features = features.float()
        logits = add_per_head_dot_(self.seed_terms(inputs, layers), features, self.feature_weight[layers])
        hidden = per_head_affine(features, self.feature_in[layers], self.feature_in_bias[layers])
        return add_per_head_dot_(logits, torch.relu_(hidden), self.feature_out[layers])
