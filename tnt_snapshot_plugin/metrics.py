"""Snapshot figures where users watch their runs: Python logging and the framework's logger.

Every committed snapshot gives one INFO line on the ``tnt_snapshot_plugin.saving.saver`` logger
(:func:`log_line`) and, when an adapter was given a framework logger, one set of metrics
(:func:`snapshot_metrics`) through the ``tnt_snapshot_plugin_snapshot_committed`` hook:

========================== =====================================================================
``snapshot/stall_s``       how long the training thread was blocked taking it
``snapshot/durable_s``     from its start until it was committed (durable and visible to restore)
``snapshot/bytes_written`` bytes of its files, all ranks
``snapshot/write_MBps``    ``bytes_written / durable_s``, in MB/s
``snapshot/waited_s``      how long training waited for the previous snapshot before taking it
``snapshot/busy_waits``    how many times so far training waited for a snapshot being written
``snapshot/skipped``       how many due snapshots were skipped so far: the previous one was
                           still being written after training had waited ``storage_timeout_s``
========================== =====================================================================
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from tnt_snapshot_plugin.errors import MetricsWarning
from tnt_snapshot_plugin.hooks import hookimpl

Sink = Callable[[dict[str, float], int], None]


def snapshot_metrics(record: Any) -> dict[str, float]:
    """The figures of one committed snapshot (a ``SnapshotRecord``), by metric name."""
    return {
        "snapshot/stall_s": float(record.stall_s),
        "snapshot/durable_s": float(record.durable_s),
        "snapshot/bytes_written": float(record.bytes_written),
        "snapshot/write_MBps": record.write_bytes_per_s / 1e6,
        "snapshot/waited_s": float(record.waited_s),
        "snapshot/busy_waits": float(record.busy_waits),
        "snapshot/skipped": float(getattr(record, "skipped", 0)),
    }


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def log_line(record: Any) -> str:
    """The INFO line logged for every committed snapshot."""
    line = (
        f"snapshot {record.path} committed: training blocked {record.stall_s:.3f}s, durable after "
        f"{record.durable_s:.3f}s, {_size(record.bytes_written)} written "
        f"({record.write_bytes_per_s / 1e6:.1f} MB/s)"
    )
    if record.waited_s:
        line += f"; before it, training waited {record.waited_s:.3f}s for the previous one"
    skipped = getattr(record, "skipped", 0)
    if skipped:
        line += f"; {skipped} due snapshot{'s' if skipped != 1 else ''} skipped so far (storage too slow)"
    return line


class MetricsReporter:
    """A plugin that sends each committed snapshot's figures of one saver to ``sink(metrics,
    step)``, on rank 0 only. Registered by :meth:`Snapshotter.report_metrics` on that saver's own
    plugin manager, for one run; a record that saver did not just commit (another saver given
    the same manager) is not its to report. ``stats``: the saver's figures; ``rank()``: this
    process's rank among the saver's.

    A sink that raises is reported with a warning, never over training.
    """

    def __init__(self, sink: Sink, stats: Any, rank: Callable[[], int]) -> None:
        self._sink = sink
        self._stats = stats
        self._rank = rank

    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path: str, step: int, record: Any) -> None:
        committed = self._stats.committed
        if not committed or committed[-1] is not record or self._rank() != 0:
            return  # another saver's snapshot, or not the rank that logs
        try:
            self._sink(snapshot_metrics(record), step)
        except Exception as exc:  # never fail training over a metric
            warnings.warn(f"could not log the metrics of snapshot {path}: {type(exc).__name__}: {exc}", category=MetricsWarning, stacklevel=2)
