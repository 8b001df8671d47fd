"""torchsnapshot's format, written: one saver's :class:`TorchsnapshotWriter` (the format seam's
writer, ``format.base.FormatWriter``).

On every rank a snapshot's state is flattened into manifest records and payloads (``writer``),
the values every rank holds alike written once (``encoding.agree_replicated``, a collective), and
each payload handed to the sink as soon as it is complete, while the rest is still planned. What
a rank sends rank 0 is its records, or on several ranks what changed in its group of the metadata
since the last snapshot (``coordination.RecordDeltas``); rank 0 writes ``.snapshot_metadata`` from
every rank's group and records in the plugin's index where each group lies (``"ranks"``).
"""

from __future__ import annotations

from typing import Any, Optional

from tnt_snapshot_plugin.distributed import Collectives
from tnt_snapshot_plugin.format.base import MetadataBytes, PayloadSink
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt
from tnt_snapshot_plugin.format.torchsnapshot.coordination import (
    RecordDeltas,
    grouped_metadata,
    sharded_shapes,
)
from tnt_snapshot_plugin.format.torchsnapshot.encoding import agree_replicated, flatten, unencodable


class TorchsnapshotWriter:
    """Writes snapshots of one saver in torchsnapshot's format (``format.base.FormatWriter``),
    keeping between snapshots the last plan's layout (reused while the state's layout is
    unchanged) and, on several ranks, the records rank 0 holds."""

    def __init__(self, collectives: Collectives) -> None:
        self.coll = collectives
        #: the last plan's tensor layout, reused while the state's layout is unchanged
        self.plans = fmt.PlanCache()
        #: where a reused plan gathers packs of tensors apart in memory (fmt.PackBuffer)
        self._pack_buffer = fmt.PackBuffer()
        #: the records rank 0 holds from the last snapshot: later ones send what changed
        self.deltas = RecordDeltas(enabled=collectives.world_size > 1)
        #: (rank 0, several ranks) the whole shape of each sharded tensor, for the index's "ranks"
        self._shapes: dict[str, list[int]] = {}

    def encode(self, job: Any, sink: PayloadSink) -> tuple[dict[str, str], Optional[BaseException]]:
        coll = self.coll
        containers, leaves, error = flatten(job)
        # Collective, made by every rank whatever happened above.
        replicated = agree_replicated(coll, job, leaves if error is None else {})
        if error is not None:
            return {}, error
        self._shapes = sharded_shapes(leaves) if coll.rank == 0 and coll.world_size > 1 else {}
        try:
            entries = fmt.plan(
                containers,
                leaves,
                rank=coll.rank,
                world_size=coll.world_size,
                replicated=replicated,
                emit=sink.submit,
                cache=self.plans,
                # A pack is gathered into one buffer, reused by the next pack, only where
                # nothing reads it after submit() returns.
                pack_buffer=self._pack_buffer if sink.copies else None,
            ).entries
        except Exception as exc:
            # A failure of the storage comes out of sink.submit (the sink reports the write that
            # failed first); any other is the format's, encoding the state.
            if exc is sink.failed:
                return {}, None
            return {}, unencodable(job, exc, leaves)
        return entries, None

    def outgoing(self, records: dict[str, str]) -> Any:
        return self.deltas.outgoing(records)

    def metadata(self, gathered: list[Any]) -> tuple[MetadataBytes, dict[str, Any]]:
        deltas = self.deltas
        zeros = [deltas.incoming(rank, part) for rank, part in enumerate(gathered)]
        # each rank's records together, and where they lie in the metadata (coordination.py)
        metadata, regions = grouped_metadata(zeros, deltas.groups(len(zeros)), self.coll.world_size)
        extra: dict[str, Any] = {}
        if regions is not None:
            extra["ranks"] = {"regions": regions, "shapes": self._shapes}
        return metadata, extra

    def aborted(self) -> None:
        self.deltas.reset()  # on every rank: the next snapshot sends every record again

    def settled(self) -> None:
        self.deltas.settle()

    def new_run(self) -> None:
        self.plans.clear()
        self.deltas.reset()

    def close(self) -> None:
        self._pack_buffer = fmt.PackBuffer()
