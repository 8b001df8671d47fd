"""DCP's on-disk format (``torch.distributed.checkpoint``), written and read by the plugin itself
(:data:`FORMAT`, ``SnapshotConfig(format="dcp")``).

A snapshot is a directory that stock ``torch.distributed.checkpoint.load`` reads with its default
``FileSystemReader``, and torchtnt's ``DistributedCheckpointSaver.restore`` restores: payload files
``R/__R_N.distcp`` (rank R's, each a run of ``torch.save`` records) and ``.metadata``, DCP's own
pickled ``Metadata`` (every entry's chunks, the file and byte range of each, the flattening of the
state dict), written last by the plugin's commit. Beside them, as in every snapshot the plugin
commits, its index holds the size and checksum of every file (one checksum per record, so a
record read alone is verified) and the commit sequence number.

**Layout.** The state dict DCP sees is the plugin's app state under ``app_state``, as torchtnt's
DCP saver lays it out (fully qualified names ``app_state.<key>.<...>``), planned by DCP's own
``DefaultSavePlanner`` (its deduplication of replicated tensors, its chunks of ``DTensor`` and
``ShardedTensor`` values, resharding at restore):

* on one rank, every value lies under ``app_state.<key>``;
* on several ranks, ``app_state.<key>`` holds what every rank restores alike: the entries the
  ``replicated`` globs (and the DDP modules) name, and every sharded tensor (each rank's chunks);
  a value that may differ between ranks (the RNG state, the dataloader's position, the progress
  counters, any entry not replicated or sharded) lies under ``per_rank.<R>.<key>.<...>`` for
  each rank R, where DCP's deduplication leaves every rank's own. Rank 0's own values are also
  entries under ``app_state.<key>`` that share rank 0's records (no byte is written twice), so
  that torchtnt's DCP restore and ``dcp.load`` of ``{"app_state": ...}``, which know no ranks,
  find every entry, as they would in a snapshot of one rank. The plugin's restore gives each
  rank its own values on the same world size; on another one, the rules of torchsnapshot's
  format apply (a value equal on every saved rank maps onto any rank, others are refused by name,
  the RNG states are not restored).

DCP stores dict keys as strings: the keys of a dict that were ints (an optimizer's parameter
ids) are recorded in the plugin's index (``"dcp": {"int_keys": ...}``) and come back as ints; a
dict whose keys are neither str nor int, or a dict type other than ``dict``/``OrderedDict``, is
saved whole as one pickled value, as torchsnapshot's format does.

* :mod:`.layout`: the state dict <-> fully qualified names, and back into state dicts.
* :mod:`.metadata`: ``.metadata`` read by a restricted unpickler and validated (the one reader).
* :mod:`.writing`: the seam's writer; :mod:`.checking`: the format's part of ``verify``;
  :mod:`.reading`: the seam's reader; :mod:`.entries`: the entries and values the command line
  reads.

Importing this package imports no torch: the modules that do are imported when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from tnt_snapshot_plugin.format.registry import BUILTIN_METADATA

if TYPE_CHECKING:
    from tnt_snapshot_plugin.distributed import Collectives
    from tnt_snapshot_plugin.format.base import EntryInfo
    from tnt_snapshot_plugin.format.dcp.reading import DcpReader
    from tnt_snapshot_plugin.format.dcp.writing import DcpWriter
    from tnt_snapshot_plugin.format.files import SnapshotFiles
    from tnt_snapshot_plugin.format.verify import Verdict

#: The metadata file of a DCP checkpoint, written last.
METADATA_FNAME = BUILTIN_METADATA["dcp"]


class DcpFormat:
    """DCP's format through the format seam (``format.base.Format``)."""

    name = "dcp"
    metadata_file = METADATA_FNAME

    def writer(self, collectives: Collectives, config: Any) -> DcpWriter:
        from tnt_snapshot_plugin.format.dcp.writing import DcpWriter

        return DcpWriter(collectives, config)

    def reads_by_rank(self, index: Optional[dict[str, Any]], ranks: int) -> bool:
        return False  # every restoring rank reads the whole .metadata; rank 0's check parses it

    def check(self, files: SnapshotFiles, verdict: Verdict, *, size_of: Callable[[str], Optional[int]]) -> None:
        from tnt_snapshot_plugin.format.dcp.checking import check

        check(files, verdict, size_of)

    def check_payloads(self, files: SnapshotFiles, verdict: Verdict) -> None:
        from tnt_snapshot_plugin.format.dcp.checking import check_payloads

        check_payloads(files, verdict)

    def reader(self, files: SnapshotFiles, collectives: Collectives, verdict: Optional[Verdict], *, weights_only: bool) -> DcpReader:
        from tnt_snapshot_plugin.format.dcp.reading import DcpReader

        return DcpReader(files, collectives, verdict, weights_only=weights_only)

    def entries(self, verdict: Verdict) -> dict[str, EntryInfo]:
        from tnt_snapshot_plugin.format.dcp.entries import entries

        return entries(verdict.metadata)

    def read_entry(self, files: SnapshotFiles, verdict: Verdict, path: str) -> Any:
        from tnt_snapshot_plugin.format.dcp.entries import read_entry

        return read_entry(files, verdict.metadata, path)

    def read_key(self, files: SnapshotFiles, verdict: Verdict, key: str) -> Any:
        from tnt_snapshot_plugin.format.dcp.entries import read_key

        return read_key(files, verdict.metadata, key)

    def __repr__(self) -> str:
        return "DcpFormat()"


#: DCP's format, as the registry hands it out (``format.registry.get_format``).
FORMAT = DcpFormat()

__all__ = ["FORMAT", "METADATA_FNAME", "DcpFormat"]
