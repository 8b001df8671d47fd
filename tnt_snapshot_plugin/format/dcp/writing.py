"""DCP's format, written: one saver's :class:`DcpWriter` (the format seam's writer,
``format.base.FormatWriter``).

On every rank a snapshot's state becomes the state dict DCP sees (``layout``: ``app_state`` and,
on several ranks, ``per_rank``), planned by DCP's ``DefaultSavePlanner``: each rank's local plan,
gathered on rank 0 over the plugin's collectives, where the planner makes the global plan and the
metadata (deduplicating what several ranks hold), and each rank's part of it sent back. Each
planned record is then what DCP's ``FileSystemWriter`` writes (a tensor chunk ``torch.save``'d, a
pickled value as its bytes), handed to the sink in files of rank R (``R/__R_N.distcp``): a record
of ``PACK_BYTES`` or more in a file of its own, its tensor's bytes not copied; smaller ones packed
end to end into files of about ``PACK_BYTES``, each record checksummed on its own. What a rank
sends rank 0 is its records' places (DCP's ``WriteResult``); rank 0 writes ``.metadata`` as
``FileSystemWriter.finish`` does.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import uuid
from typing import Any, Optional

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.errors import UnrestorableStateError
from tnt_snapshot_plugin.format.base import MetadataBytes, Payload, PayloadSink
from tnt_snapshot_plugin.format.dcp.layout import APP_STATE, PER_RANK, Path, Replicated, fqn, is_sharded, walk
from tnt_snapshot_plugin.format.torchsnapshot.encoding import agree_replicated, flatten, unencodable

#: A record of this many bytes or more gets a file of its own; smaller ones are packed together
#: into files of about this size (as torchsnapshot's format packs small tensors).
PACK_BYTES = 4 << 20


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner; with one rank's plan there is nothing to deduplicate."""

    def _dedup_save_plans(self, all_plans: list[Any]) -> list[Any]:
        return all_plans if len(all_plans) == 1 else super()._dedup_save_plans(all_plans)


class DcpWriter:
    """Writes snapshots of one saver in DCP's format (``format.base.FormatWriter``)."""

    def __init__(self, collectives: Collectives, config: Any = None) -> None:
        self.coll = collectives
        #: (rank 0) the global plan's metadata of the snapshot being written
        self._metadata: Any = None
        #: the snapshot's path, recorded as DCP's checkpoint id
        self._path: Optional[str] = None
        #: (rank 0, several ranks) ``app_state`` name -> the ``per_rank.0`` name whose records it
        #: shares: rank 0's own values where torchtnt's restore and ``dcp.load`` look
        self._aliases: dict[str, str] = {}

    # -- encode ---------------------------------------------------------------------------

    def encode(self, job: Any, sink: PayloadSink) -> tuple[Any, Optional[BaseException]]:
        coll = self.coll
        self._metadata, self._path, self._aliases = None, job.path, {}
        error: Optional[BaseException] = None
        replicated: Optional[Replicated] = None
        if coll.world_size > 1:
            _containers, leaves, error = flatten(job)
            # Collective, made by every rank whatever happened above.
            agreed = agree_replicated(coll, job, leaves if error is None else {})
            replicated = Replicated(leaves, agreed)
        # The state is flattened here (layout.walk): a value saved whole stays whole, a dict too.
        planner = _SavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
        plan: Any = None
        int_keys: list[list[Any]] = []
        if error is None:
            try:
                state, mappings, int_keys = self._state(job, replicated)
                planner.set_up_planner(state, storage_meta=None, is_coordinator=coll.rank == 0)
                plan = dataclasses.replace(planner.create_local_plan(), planner_data=mappings)
            except Exception as exc:
                error = unencodable(job, exc, None)
        # Collectives, made by every rank whatever happened above: the local plans to rank 0,
        # and each rank's part of the global plan (or why there is none) back.
        plans = coll.gather(plan)
        outcome = self._global_plan(planner, plans) if coll.rank == 0 else None
        outcome = coll.broadcast(outcome)
        if error is not None:
            return None, error
        assert outcome is not None
        ok, value = outcome
        if not ok:
            if value is None:  # another rank failed: its error is the one reported
                return None, None
            return None, UnrestorableStateError(f"snapshot {job.name}: {value}")
        final = planner.finish_plan(value[coll.rank])
        try:
            results = self._write(final, planner, sink)
        except Exception as exc:
            # A failure of the storage comes out of sink.submit (the sink reports the write that
            # failed first); any other is the format's, encoding the state.
            if exc is sink.failed:
                return None, None
            return None, unencodable(job, exc, None)
        return {"results": results, "int_keys": int_keys}, None

    def _state(self, job: Any, replicated: Optional[Replicated]) -> tuple[dict[str, Any], dict[str, Path], list[list[Any]]]:
        """The state dict DCP sees (fully qualified name -> value), each name's path, and the
        dicts whose keys include ints."""
        rank = self.coll.rank
        state: dict[str, Any] = {}
        mappings: dict[str, Path] = {}
        int_keys: list[list[Any]] = []
        shared: Path = (APP_STATE,)
        own: Path = (PER_RANK, str(rank))
        for key, frozen in job.frozen.items():
            leaves, ints = walk(key, frozen.state_dict())
            int_keys.extend(ints)
            for path, value in leaves:
                prefix = shared if replicated is None or is_sharded(value) or replicated(path) else own
                name = fqn(prefix, path)
                if name in state:
                    other = mappings[name][len(prefix):]
                    raise UnrestorableStateError(
                        f"snapshot {job.name}: the app-state entries {'/'.join(map(str, other))!r} and "
                        f"{'/'.join(map(str, path))!r} have the same name {name!r} in DCP's format, which "
                        "joins keys with dots; rename one of them, or save with format='torchsnapshot'"
                    )
                if isinstance(value, torch.Tensor) and (value.layout != torch.strided or value.is_quantized):
                    raise UnrestorableStateError(
                        f"snapshot {job.name}: the app-state entry {'/'.join(map(str, path))!r} is a "
                        f"{'quantized' if value.is_quantized else str(value.layout)} tensor, which DCP's "
                        "format cannot restore (its reads copy chunks into dense tensors). Nothing was "
                        "committed. Save with format='torchsnapshot', or store it as dense tensors "
                        "(e.g. to_dense(), dequantize())"
                    )
                state[name] = value
                mappings[name] = prefix + path
        sharded = {name: value for name, value in state.items() if isinstance(value, ShardedTensor)}
        if sharded:  # a ShardedTensor whose shards are ShardedTensors (2-D FSDP): its inner shards
            state.update(_flatten_sharded_tensors(sharded))
        return state, mappings, int_keys

    def _global_plan(self, planner: _SavePlanner, plans: Optional[list[Any]]) -> tuple[bool, Any]:
        """Rank 0: (True, every rank's part of the global plan), or (False, why not: None when a
        rank has no local plan, having failed)."""
        assert plans is not None
        if any(plan is None for plan in plans):
            return False, None
        try:
            global_plans, metadata = planner.create_global_plan(plans)
        except Exception as exc:  # DCP's planner refuses the state (chunks that do not tile)
            return False, (
                f"DCP's planner refuses the state ({type(exc).__name__}: {exc}); nothing was committed. "
                "The ranks' DTensor or ShardedTensor chunks of one tensor must cover it exactly once"
            )
        merged: dict[str, Path] = {}
        for plan in plans:
            merged.update(plan.planner_data or {})
        # Rank 0's own values also under app_state (the same records, not written twice): what
        # torchtnt's DCP restore and dcp.load of {"app_state": ...} read, as from one rank.
        entries = metadata.state_dict_metadata
        first = (PER_RANK, "0")
        for name, path in list(merged.items()):
            if path[:2] == first:
                alias_path = (APP_STATE, *path[2:])
                alias = fqn((), alias_path)
                if alias not in entries and alias not in merged:
                    entries[alias] = entries[name]
                    merged[alias] = alias_path
                    self._aliases[alias] = name
        self._metadata = dataclasses.replace(metadata, planner_data=merged)
        return True, global_plans

    def _write(self, plan: Any, planner: _SavePlanner, sink: PayloadSink) -> list[Any]:
        """Write ``plan``'s records through ``sink``; their places (DCP's ``WriteResult``)."""
        files = _Files(self.coll.rank, sink)
        for item in plan.items:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):  # a pickled value (WriteItemType.BYTE_IO)
                files.add(item.index, [data.getbuffer()])
            else:
                files.add(item.index, serialized(data))
        files.flush()
        return files.results

    # -- the rest of the seam -------------------------------------------------------------

    def outgoing(self, records: Any) -> Any:
        return records

    def metadata(self, gathered: list[Any]) -> tuple[MetadataBytes, dict[str, Any]]:
        storage: dict[Any, Any] = {}
        int_keys: dict[tuple[Any, ...], set[int]] = {}
        for part in gathered:
            for result in part["results"]:
                storage[result.index] = result.storage_data
            for path, keys in part["int_keys"]:
                int_keys.setdefault(tuple(path), set()).update(keys)
        if self._aliases:
            by_name: dict[str, list[Any]] = {}
            for index in storage:
                by_name.setdefault(index.fqn, []).append(index)
            for alias, name in self._aliases.items():
                for index in by_name.get(name, ()):
                    storage[MetadataIndex(alias, index.offset)] = storage[index]
        metadata = dataclasses.replace(
            self._metadata,
            storage_data=storage,
            version=CURRENT_DCP_VERSION,
            storage_meta=StorageMeta(checkpoint_id=self._path, save_id=str(uuid.uuid4())),
        )
        extra: dict[str, Any] = {}
        if int_keys:
            extra["dcp"] = {"int_keys": [[list(path), sorted(keys)] for path, keys in int_keys.items()]}
        return pickle.dumps(metadata), extra

    def aborted(self) -> None:
        self._metadata, self._aliases = None, {}

    def settled(self) -> None:
        self._metadata, self._aliases = None, {}

    def new_run(self) -> None:
        self.settled()

    def close(self) -> None:
        self.settled()


class _Files:
    """The payload files of one rank: records of ``PACK_BYTES`` or more in files of their own,
    smaller ones (one buffer each) packed into files of about ``PACK_BYTES``."""

    def __init__(self, rank: int, sink: PayloadSink) -> None:
        self.rank, self.sink = rank, sink
        self.results: list[Any] = []
        self._count = 0
        self._pack: list[Any] = []
        self._pack_indices: list[Any] = []
        self._pack_bytes = 0

    def _rel(self) -> str:
        rel = f"{self.rank}/__{self.rank}_{self._count}.distcp"
        self._count += 1
        return rel

    def add(self, index: Any, views: list[Any]) -> None:
        size = sum(v.nbytes for v in views)
        if size >= PACK_BYTES or len(views) > 1:
            rel = self._rel()
            self.results.append(WriteResult(index=index, size_in_bytes=size, storage_data=_StorageInfo(rel, 0, size)))
            self.sink.submit(Payload(rel, views))
            return
        if self._pack and self._pack_bytes + size > PACK_BYTES:
            self.flush()
        self._pack.extend(views)
        self._pack_indices.append((index, self._pack_bytes, size))
        self._pack_bytes += size

    def flush(self) -> None:
        if not self._pack:
            return
        rel = self._rel()
        for index, offset, size in self._pack_indices:
            self.results.append(WriteResult(index=index, size_in_bytes=size, storage_data=_StorageInfo(rel, offset, size)))
        # one view a record: each is checksummed on its own, as a reader reads it
        self.sink.submit(Payload(rel, self._pack))
        self._pack, self._pack_indices, self._pack_bytes = [], [], 0


def serialized(tensor: torch.Tensor) -> list[Any]:
    """The bytes ``torch.save`` writes of ``tensor`` (a chunk as DCP writes it: detached, on the
    CPU, a storage of its own bytes), as buffers to write one after another: one for a tensor
    under ``PACK_BYTES``; else the archive's own records copied, and the tensor's bytes as a view
    of its memory (not copied)."""
    tensor = _own_storage(tensor)
    if tensor.nbytes < PACK_BYTES:
        buf = io.BytesIO()
        torch.save(tensor, buf)
        return [buf.getbuffer()]
    capture = _Capture(tensor)
    torch.save(tensor, capture)  # type: ignore[arg-type]  # a file torch.save writes to
    return capture.views()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, on the CPU, contiguous, with a storage holding its bytes only (a view
    into a larger buffer, such as an asynchronous snapshot's staging arena, gets a tensor over
    the same memory with a storage of its own: ``torch.save`` writes a tensor's whole storage)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    if tensor.numel() == 0:
        return tensor.clone()
    try:
        flat = tensor.reshape(-1).view(torch.uint8).numpy()
        return torch.from_numpy(flat).view(tensor.dtype).reshape(tensor.shape)
    except (RuntimeError, TypeError):  # a dtype without a byte view
        return tensor.clone()


class _Capture(io.RawIOBase):
    """A file for ``torch.save`` that keeps what it is given: the tensor's own bytes as a view of
    its memory, everything else copied (torch hands its other records over in buffers it reuses)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        self._raw = tensor.reshape(-1).view(torch.uint8).numpy()
        self._start = self._raw.ctypes.data
        self._end = self._start + self._raw.nbytes
        self._views: list[Any] = []
        self._pending = bytearray()
        self._pos = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        n = view.nbytes
        self._pos += n
        if n >= 4096:
            at = np.frombuffer(view, dtype=np.uint8).ctypes.data
            if self._start <= at and at + n <= self._end:
                self._take_pending()
                offset = at - self._start
                self._views.append(self._raw[offset:offset + n])
                return n
        self._pending += view
        return n

    def _take_pending(self) -> None:
        if self._pending:
            self._views.append(memoryview(self._pending))
            self._pending = bytearray()

    def views(self) -> list[Any]:
        self._take_pending()
        return self._views


__all__ = ["PACK_BYTES", "DcpWriter", "serialized"]
