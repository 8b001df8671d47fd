"""Restoring onto another world size: which entries map exactly onto the ranks now running, and
an error naming those that cannot."""

from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional
from urllib.parse import unquote

from tnt_snapshot_plugin.app_state import RNG_STATE_KEY
from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import PartialRestoreWarning, SnapshotCorruptError, StateMismatchError
from tnt_snapshot_plugin.format.torchsnapshot.common import encode
from tnt_snapshot_plugin.format.torchsnapshot.manifest import CONTAINER_TYPES, PRIMITIVE_TYPES, SHARDED_TYPES

#: How many entries a world-size error names before it counts the rest.
_NAMED_ENTRIES = 12


def fit_world_size(
    path: str, meta: Any, read_into: Any, file_size: Any, verifier: Any, keys: Iterable[str], coll: Collectives
) -> tuple[bool, list[str]]:
    """Make the entries of ``keys`` that map exactly onto this world size available to every rank,
    or raise StateMismatchError naming those that cannot; whether the RNG state maps, and the
    per-rank entries found equal on every saved rank (marked in ``meta``: :func:`mark_same`).

    A snapshot taken on N ranks restores exactly on M != N ranks where every entry is replicated
    (saved once for all ranks), sharded (ShardedTensor, DTensor: resharded as they are read), or
    saved per rank with the same value on every rank (progress counters, a full state dict saved
    on every rank: read and compared here, on rank 0). A per-rank entry whose values differ (an
    optimizer's flat FSDP1 shards, a loader's position) has no value for a rank of another world
    size. The RNG state, per rank by nature, is then not restored, with a warning, rather than
    refusing every world-size change. Every rank reaches the same verdict (rank 0 decides).
    """
    saved = meta.world_size
    comparison = _Comparison(meta, {encode(key) for key in keys}, read_into, file_size, verifier)
    same, differ, unreadable = coll.on_rank0(comparison.verdict)
    if unreadable is not None:
        raise SnapshotCorruptError(
            f"could not read snapshot {path}'s per-rank entries to restore it on "
            f"{_ranks(coll.world_size)} (taken on {_ranks(saved)}): {unreadable}"
        )
    rng_prefix = encode(RNG_STATE_KEY) + "/"
    rng_differs = [p for p in differ if p.startswith(rng_prefix)]
    differ = [p for p in differ if not p.startswith(rng_prefix)]
    if differ:
        named = ", ".join(unquote(p) for p in differ[:_NAMED_ENTRIES])
        more = f" and {len(differ) - _NAMED_ENTRIES} more" if len(differ) > _NAMED_ENTRIES else ""
        raise StateMismatchError(
            f"cannot restore {path} on {_ranks(coll.world_size)}: it was taken on {_ranks(saved)}, "
            "and these entries were saved per rank with different values (or not by every rank), "
            f"so they have no value for a world of {_ranks(coll.world_size)}: {named}{more}. "
            f"Restore on {_ranks(saved)}; or save such state replicated (replicated=[...]) or "
            "sharded (FSDP's SHARDED_STATE_DICT, DTensor); or leave those entries out of the restore"
        )
    mark_same(meta, same)
    if rng_differs:
        warnings.warn(
            f"snapshot {path} was taken on {_ranks(saved)} and is restored on {_ranks(coll.world_size)}: "
            "its RNG states are per rank, so they are not restored (every other entry is)",
            category=PartialRestoreWarning, stacklevel=4,
        )
        return False, same
    return True, same


def mark_same(meta: Any, same: Iterable[str]) -> None:
    """Entries equal on every saved rank (``same``: logical paths) are rank 0's for every rank
    of the new world: marked replicated in this in-memory copy of the metadata (nothing is
    written)."""
    for logical in same:
        entry = meta.manifest.get(f"0/{logical}")
        if entry is not None and "replicated" in entry:
            entry["replicated"] = True


class _Comparison:
    """Rank 0's comparison of the per-rank entries of the app-state keys ``wanted`` (encoded)."""

    def __init__(self, meta: Any, wanted: set[str], read_into: Any, file_size: Any, verifier: Any) -> None:
        self.meta, self.wanted = meta, wanted
        self.read_into, self.file_size, self.verifier = read_into, file_size, verifier

    def per_rank_entries(self) -> dict[str, dict[int, Any]]:
        """logical path -> saved rank -> its entry (a rank without one left out): as many
        entries as the manifest holds, whatever its world size says."""
        out: dict[str, dict[int, Any]] = {}
        replicated: set[str] = set()
        for full, entry in self.meta.manifest.items():
            rank, _, logical = full.partition("/")
            kind = entry.get("type")
            if logical.split("/", 1)[0] not in self.wanted or kind in _CONTAINERS:
                continue
            if kind in SHARDED_TYPES or entry.get("replicated"):
                replicated.add(logical)
                continue
            out.setdefault(logical, {})[int(rank)] = entry
        for logical in replicated:
            out.pop(logical, None)
        return out

    def read(self, rank: int, logical: str) -> Any:
        # Verified as every read is: a damaged copy is damage (restore_from_latest falls back
        # to an older snapshot), not a value that differs (which refuses the world-size change).
        from tnt_snapshot_plugin.format.torchsnapshot import reader as fmt

        return fmt.read_value(
            self.meta.manifest, f"{rank}/{logical}", self.read_into, file_size=self.file_size, verifier=self.verifier
        )

    def verdict(self) -> tuple[list[str], list[str], Optional[str]]:
        """(logical paths equal on every saved rank, those that are not, a read error)."""
        same: list[str] = []
        differ: list[str] = []
        to_read: list[str] = []
        for logical, by_rank in self.per_rank_entries().items():
            if len(by_rank) < self.meta.world_size:  # a rank without one
                differ.append(logical)
            elif all(e.get("type") in _PRIMITIVES for e in by_rank.values()):
                values = {(e["type"], e.get("serialized_value")) for e in by_rank.values()}
                (same if len(values) == 1 else differ).append(logical)
            else:
                to_read.append(logical)
        try:
            for logical in to_read:
                first = self.read(0, logical)
                equal = all(_same_value(first, self.read(r, logical)) for r in range(1, self.meta.world_size))
                (same if equal else differ).append(logical)
        except Exception as exc:  # damaged bytes: every rank raises it as corruption below
            return [], [], f"{type(exc).__name__}: {exc}"
        return sorted(same), sorted(differ), None


_CONTAINERS = CONTAINER_TYPES
_PRIMITIVES = PRIMITIVE_TYPES


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _same_value(a: Any, b: Any) -> bool:
    """Whether two values read from a snapshot are the same, bit for bit for tensors."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a_bytes = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        b_bytes = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return torch.equal(a_bytes, b_bytes)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is not a truth value: not provably the same
        return False
