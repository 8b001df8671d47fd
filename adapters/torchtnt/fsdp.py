"""Optimizer state of FSDP modules, through torch's own FSDP state-dict APIs.

An optimizer over an FSDP module's parameters holds state for FSDP's internal parameters (FSDP1:
each rank's slice of the flattened parameters; FSDP2: DTensor shards). Its own ``state_dict()`` is
therefore only meaningful to the same wrapping on the same world size. Torch's FSDP APIs turn it
into state keyed by the parameters' names, laid out as the module's state-dict type asks (FSDP1:
``FSDP.set_state_dict_type``, full or ``ShardedTensor``; FSDP2: ``DTensor``), and back:

* FSDP1 (``FullyShardedDataParallel``): ``FSDP.optim_state_dict`` / ``FSDP.optim_state_dict_to_load``;
* FSDP2 (``fully_shard``): ``torch.distributed.checkpoint.state_dict``'s
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.

Both are collectives: every rank saves and restores the same entries, as the plugin always does.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch


def fsdp_kind(module: Any) -> Optional[str]:
    """``"fsdp1"`` for a ``FullyShardedDataParallel`` root, ``"fsdp2"`` for a module given to
    ``fully_shard``, else None."""
    if not isinstance(module, torch.nn.Module):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        return "fsdp1"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return "fsdp2" if isinstance(module, FSDPModule) else None


class FSDPOptimizerState:
    """A Stateful over ``optimizer`` of FSDP module ``module`` (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        kind = fsdp_kind(module)
        if kind is None:
            raise TypeError(f"{type(module).__name__} is not an FSDP module")
        self.module = module
        self.optimizer = optimizer
        self.__wrapped__ = optimizer  # what restore errors are attributed to
        self.kind = kind

    def state_dict(self) -> dict[str, Any]:
        if self.kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel.optim_state_dict(self.module, self.optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, self.optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.kind == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            flat = FullyShardedDataParallel.optim_state_dict_to_load(
                self.module, self.optimizer, state_dict
            )
            self.optimizer.load_state_dict(flat)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict)


def wrap_fsdp_optimizers(
    modules: Mapping[str, Any], optimizers: Mapping[str, Any]
) -> dict[str, Any]:
    """``optimizers`` with each one over an FSDP module's parameters wrapped in
    :class:`FSDPOptimizerState` (the others as they are).

    An optimizer belongs to the FSDP module that holds all of its parameters; one whose
    parameters span an FSDP module and anything else cannot be saved through FSDP's APIs and
    raises ConfigError.
    """
    from tnt_snapshot_plugin.errors import ConfigError

    owners = []
    for module in modules.values():
        if fsdp_kind(module) is not None:
            owners.append((module, {id(p) for p in module.parameters()}))
    out: dict[str, Any] = {}
    for key, optimizer in optimizers.items():
        params = [p for group in getattr(optimizer, "param_groups", ()) for p in group["params"]]
        out[key] = optimizer
        for module, owned in owners:
            inside = [id(p) in owned for p in params]
            if params and all(inside):
                out[key] = FSDPOptimizerState(module, optimizer)
                break
            if any(inside):
                raise ConfigError(
                    f"optimizer {key!r} holds parameters of FSDP module {type(module).__name__} "
                    "and of other modules; FSDP's optimizer state dict needs one optimizer per "
                    "FSDP root module"
                )
    return out
