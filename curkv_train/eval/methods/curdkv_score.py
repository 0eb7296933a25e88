"""CurDKV: leverage scores of keys times values (https://arxiv.org/abs/2509.15038).

The leverage of token j in a matrix A is approximated by its squared row norm over
the squared Frobenius norm (CUR row sampling), normalised within local blocks of
``local_window_size`` tokens; key and value leverage are multiplied. Same
definition as kvpress's CURPress with its defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from curkv_train.eval.context import LayerContext

LEVERAGE_TYPES = ("key", "value", "kv_avg", "kv_product")


def local_share(energy: torch.Tensor, block: int) -> torch.Tensor:
    """Each entry of ``energy`` (..., tokens) over the sum of its block of ``block`` consecutive tokens."""
    tokens = energy.shape[-1]
    padded = F.pad(energy, (0, (block - tokens % block) % block))
    blocks = padded.reshape(*energy.shape[:-1], -1, block)
    share = blocks / blocks.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(blocks.dtype).tiny)
    return share.reshape(*energy.shape[:-1], -1)[..., :tokens]


@dataclass
class CurDKVScore:
    """Approximate key/value leverage scores, combined by ``leverage_type``.

    Parameters
    ----------
    leverage_type : str, default ``"kv_product"``
        ``key``, ``value``, ``kv_avg`` ((k + v) / 2) or ``kv_product`` (k · v).
    use_local_approximation : bool, default ``True``
        Normalise the squared norms within blocks of ``local_window_size`` tokens.
    local_window_size : int, default ``16``
    """

    leverage_type: str = "kv_product"
    use_local_approximation: bool = True
    local_window_size: int = 16
    needs_queries = False

    def __post_init__(self) -> None:
        if self.leverage_type not in LEVERAGE_TYPES:
            raise ValueError(f"unknown leverage_type {self.leverage_type!r}; expected one of "
                             f"{', '.join(LEVERAGE_TYPES)}")

    def __call__(self, ctx: LayerContext) -> torch.Tensor:
        """(batch, kv_heads, tokens) leverage scores summing to 1 per (batch, KV head)."""
        key_energy = ctx.keys.float().pow(2).sum(dim=-1)
        value_energy = ctx.values.float().pow(2).sum(dim=-1)
        if self.use_local_approximation:
            key_energy = local_share(key_energy, self.local_window_size)
            value_energy = local_share(value_energy, self.local_window_size)
        combined = {
            "key": key_energy,
            "value": value_energy,
            "kv_avg": (key_energy + value_energy) / 2,
            "kv_product": key_energy * value_energy,
        }[self.leverage_type]
        return combined / combined.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(combined.dtype).tiny)
