"""Replicated values: the logical paths every rank holds identically are written once, under
``0/``, each by one rank that every rank chooses alike from its own leaves (largest first, ties
by path, each to the least loaded rank)."""

from __future__ import annotations

import fnmatch
import heapq
from collections.abc import Mapping, Sequence, Set
from typing import Any

import torch

from tnt_snapshot_plugin.format.torchsnapshot.common import PLAIN_TENSOR_TYPES as _PLAIN_TENSOR_TYPES
from tnt_snapshot_plugin.format.torchsnapshot.common import PRIMITIVES as _PRIMITIVES
from tnt_snapshot_plugin.format.torchsnapshot.common import distributed_types as _distributed_types
from tnt_snapshot_plugin.format.torchsnapshot.common import tensor_nbytes as _nbytes

#: What a replicated object is assumed to cost when spreading replicated writes over the ranks
#: (its size is only known once it is serialized, and every rank must agree without serializing).
NOMINAL_OBJECT_BYTES = 1024


def replicable(leaves: Mapping[str, Any], patterns: Sequence[str]) -> list[str]:
    """The logical paths of ``leaves`` that match a glob of ``patterns`` (``fnmatch``, as
    torchsnapshot) and are not sharded. The caller gathers these from every rank and passes the
    paths every rank has to :func:`plan` as ``replicated``."""
    if not patterns:
        return []
    matched: set[str] = set()
    for pattern in patterns:
        matched.update(fnmatch.filter(leaves, pattern))
    return [path for path in leaves if path in matched and not _is_sharded(leaves[path])]


def _is_sharded(value: Any) -> bool:
    if not isinstance(value, torch.Tensor) or type(value) in _PLAIN_TENSOR_TYPES:
        return False
    sharded_tensor, dtensor, shard = _distributed_types()
    if sharded_tensor is not None and isinstance(value, sharded_tensor):
        return True
    if dtensor is not None and isinstance(value, dtensor):
        return any(isinstance(p, shard) for p in value.placements)
    return False


def _replicated_writers(leaves: Mapping[str, Any], replicated: Set[str], world_size: int) -> dict[str, int]:
    """Logical path -> the rank that writes it, for every replicated leaf. Deterministic: every
    rank holds the same replicated leaves, so every rank computes the same answer."""
    costs = sorted(
        (-_write_cost(leaves[path]), path)
        for path in replicated
        if path in leaves and not _is_sharded(leaves[path])  # a sharded value is never replicated
    )
    loads = [(0, rank) for rank in range(world_size)]  # a heap: the least loaded rank, lowest first
    writers: dict[str, int] = {}
    for negative_cost, path in costs:
        load, rank = loads[0]
        writers[path] = rank
        heapq.heapreplace(loads, (load - negative_cost, rank))
    return writers


def _write_cost(value: Any) -> int:
    if type(value) in _PRIMITIVES:
        return 0
    if isinstance(value, torch.Tensor):
        return _nbytes(value)
    return NOMINAL_OBJECT_BYTES
