"""What Lightning's own strategies need to train a small fp32 estimator on a frozen bf16 base (DESIGN §8).

Nothing here distributes anything: DDP and FSDP are Lightning's ``DDPStrategy`` and
``FSDPStrategy``, set up by the recipes. This module holds the four pieces those
strategies do not know about our model:

- :class:`KeepDtypesFSDPPrecision`: Lightning's FSDP precision plugin casts the
  whole module to one dtype (``32-true`` would upcast the 70B base to fp32 before
  sharding). This one keeps each module as loaded: base bf16, estimator fp32; every
  FSDP unit then computes and reduces in its own dtype.
- :func:`prepare_rank_zero_loading`: only global rank 0 reads the base weights; the
  other ranks hold the base on the meta device and FSDP broadcasts rank 0's values
  while it shards (``sync_module_states``).
- :func:`clip_grad_norm`: gradient clipping by the global norm over shards, which
  Lightning leaves to the module under FSDP.
- :func:`saves_sharded_checkpoints`: Lightning resumes a sharded FSDP checkpoint with
  ``torch.distributed.checkpoint``, which needs every key of the model, so such
  checkpoints keep the base's shards (see ``CurKVModule.on_save_checkpoint``).
"""

from __future__ import annotations

import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import FSDPStrategy, Strategy
from torch import nn

from curkv_train.core.errors import CurKVError


class KeepDtypesFSDPPrecision(FSDPPrecision):
    """FSDP precision that keeps every parameter in the dtype it was created in.

    Use it with ``model.base_dtype: bfloat16`` (the frozen base) and the estimator in
    fp32: FSDP flattens each wrapped unit (a decoder layer, the estimator) in its own
    dtype, casts nothing for compute, and reduces the estimator's gradients in fp32.
    Lightning's ``precision="32-true"`` would instead ``.to(float32)`` the whole module.
    """

    def __init__(self) -> None:
        super().__init__("32-true")

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module unchanged (no dtype cast)."""
        return module

    @property
    def mixed_precision_config(self):
        """FSDP ``MixedPrecision`` with no cast: parameters, buffers and reductions keep their dtypes."""
        from torch.distributed.fsdp import MixedPrecision

        return MixedPrecision()


def materialize_on_current_device(module: nn.Module) -> None:
    """FSDP ``param_init_fn``: give a meta module's own tensors real (uninitialised) storage.

    The values come from rank 0 right after, through ``sync_module_states``.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    module.to_empty(device=device, recurse=False)


def prepare_rank_zero_loading(strategy: Strategy) -> None:
    """Make ``strategy`` (FSDP) broadcast rank 0's weights into the meta skeletons of the other ranks.

    Raises:
        CurKVError: the strategy is not FSDP (DDP needs the weights on every rank).
    """
    if not isinstance(strategy, FSDPStrategy):
        raise CurKVError(f"model.base_init=rank_zero needs trainer.strategy FSDPStrategy, got "
                         f"{type(strategy).__name__}; use base_init=every_rank with DDP or one device")
    strategy.kwargs["sync_module_states"] = True
    strategy.kwargs.setdefault("param_init_fn", materialize_on_current_device)


def fsdp_root(strategy: Strategy):
    """The root ``FullyShardedDataParallel`` module when ``strategy`` is FSDP and set up, else None."""
    if not isinstance(strategy, FSDPStrategy):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = getattr(strategy, "model", None)
    return model if isinstance(model, FullyShardedDataParallel) else None


def clip_grad_norm(strategy: Strategy, max_norm: float) -> bool:
    """Clip by the global gradient norm across FSDP shards; False when ``strategy`` is not FSDP."""
    root = fsdp_root(strategy)
    if root is None:
        return False
    root.clip_grad_norm_(max_norm)
    return True


def saves_sharded_checkpoints(strategy: Strategy) -> bool:
    """Whether ``strategy`` writes FSDP sharded checkpoints (a folder of per-rank shards)."""
    return isinstance(strategy, FSDPStrategy) and getattr(strategy, "_state_dict_type", "full") == "sharded"
