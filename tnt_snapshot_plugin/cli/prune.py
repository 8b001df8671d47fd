"""``tnt-snapshot prune``: delete old snapshots by the saver's own retention rules, never while a
live run holds the directory (unless forced)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import click
from rich.filesize import decimal as human_size
from rich.text import Text

from tnt_snapshot_plugin.cli.app import (
    UsageProblem,
    cli,
    duration,
    fail,
    json_flag,
    open_target,
    path_argument,
    s3_flags,
    s3_options,
)
from tnt_snapshot_plugin.cli.output import (
    STATUS_COMPLETE,
    STATUS_DAMAGED,
    STATUS_INCOMPLETE,
    console,
    emit_json,
    new_table,
    print_table,
    say,
)
from tnt_snapshot_plugin.cli.survey import (
    SnapshotInfo,
    holds_one_snapshot,
    list_directory,
    lock_holder,
    survey,
)
from tnt_snapshot_plugin.errors import ConfigError, SnapshotError
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.policies import Best, retention, to_delete
from tnt_snapshot_plugin.stores import LEASE_FNAME, LOCK_FNAME, Store
from tnt_snapshot_plugin.stores.s3 import S3Store


@dataclass(frozen=True)
class PruneCandidate:
    """What prune's selection knows of one snapshot-named entry."""

    name: SnapshotName
    #: written by this plugin: its naming (not torchtnt's) and its index
    ours: bool
    #: has ``.snapshot_metadata``
    complete: bool
    #: the index's commit sequence number, when it records one
    seq: Optional[int] = None
    #: the value of the ``--keep-best`` metric (name suffix or the index's ``metric``), if any
    metric: Optional[float] = None


def select_for_pruning(
    candidates: list[PruneCandidate],
    *,
    keep_last: int,
    keep_best: Optional[str] = None,
    mode: str = "min",
    protect: Iterable[str] = (),
) -> dict[str, Optional[str]]:
    """Name -> None (delete) or the reason it is kept: the saver's own retention
    (``policies.to_delete``), so prune deletes exactly what the saver would.

    * only the plugin's own complete snapshots are counted and deleted; anything without the
      plugin's index (torchtnt's, a user's, an interrupted write) is kept;
    * commit order: the core's (``retention.commit_order``: the index's ``seq``; snapshots
      without one first, by (epoch, step));
    * ``keep_last`` newest are kept; with ``keep_best``, the ``keep_last`` best by that metric
      instead (``mode`` "min" or "max"; NaN worst; ties to the earlier commit; snapshots without a
      value for it are kept), as the saver's best-k (``policies.Best``) with that k;
    * the newest complete snapshot, and every name in ``protect``, are always kept.
    """
    if keep_last < 1:
        raise ConfigError(f"--keep-last must be >= 1, got {keep_last}")
    if mode not in ("min", "max"):
        raise ConfigError(f"--mode must be 'min' or 'max', got {mode!r}")
    verdict: dict[str, Optional[str]] = {}
    listed: list[retention.Listed] = []
    for c in candidates:
        if not c.complete:
            verdict[c.name.text] = "incomplete (no .snapshot_metadata): not pruned"
            continue
        if not c.ours:
            verdict[c.name.text] = (
                "written by torchtnt's saver" if c.name.phase_aware else f"no {INDEX_FNAME}: not written by this plugin"
            )
        metric = (keep_best, c.metric) if keep_best is not None and c.metric is not None else None
        listed.append(retention.Listed(c.name, seq=c.seq, ours=c.ours, indexed_metric=metric))
    best = Best(keep_best, mode, keep_last) if keep_best is not None else None
    doomed = {
        r.text
        for r in to_delete(
            listed, None if best is not None else keep_last, protect=protect, best=best
        )
    }
    verdict.update(_why_kept(listed, doomed, keep_last, keep_best, mode, set(protect)))
    return {c.name.text: verdict[c.name.text] for c in candidates}


def _why_kept(
    listed: list[retention.Listed], doomed: set[str], keep_last: int, keep_best: Optional[str], mode: str,
    protected: set[str],
) -> dict[str, Optional[str]]:
    """Each of the plugin's snapshots in ``listed``: None (deleted) or why it is kept."""
    ordered = retention.commit_order(listed)
    ours = [r for r in ordered if r.ours]
    newest = ordered[-1].text if ordered else None
    if keep_best is None:
        reasons = {r.text: f"one of the last {keep_last}" for r in ours[-keep_last:]}
    else:
        top = retention.ranked(ours, keep_best, mode)[:keep_last]
        reasons = {r.text: f"one of the {keep_last} best by {keep_best} ({r.metric_value(keep_best):g})" for r in top}
    verdict: dict[str, Optional[str]] = {}
    for r in ours:
        if r.text in doomed:
            verdict[r.text] = None
        elif r.text in reasons:
            verdict[r.text] = reasons[r.text]
        elif r.text == newest:
            verdict[r.text] = "the newest complete snapshot"
        elif r.text in protected:
            verdict[r.text] = "the snapshot restore_from_latest would restore"
        elif keep_best is not None and r.metric_value(keep_best) is None:
            verdict[r.text] = f"no value for {keep_best}"
        else:
            verdict[r.text] = "kept by the saver's retention rules"
    return verdict


def metric_value(info: SnapshotInfo, metric: str) -> Optional[float]:
    p = info.parsed
    if p is not None and p.metric == metric and p.metric_value is not None:
        return p.metric_value
    record = (info.index or {}).get("metric")
    if isinstance(record, dict) and record.get("name") == metric and isinstance(record.get("value"), (int, float)):
        return float(record["value"])
    return None


@cli.command("prune")
@path_argument("dirpath")
@click.option("--keep-last", type=click.IntRange(min=1), required=True, help="Keep the N newest (or best) snapshots.")
@click.option("--keep-best", "keep_best", default=None, metavar="METRIC",
              help="Keep the N best by METRIC (from the name's _METRIC=value or the index) instead of the newest.")
@click.option("--mode", type=click.Choice(["min", "max"]), default=None, help="With --keep-best: lower or higher is better.")
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--min-staging-age", default="1h", show_default=True, metavar="DURATION",
              help="Refuse while a staging directory or incomplete snapshot is younger (a run may be writing).")
@click.option("--force", is_flag=True, help="Prune even while a live run holds DIRPATH (its lock or lease).")
@json_flag
@s3_flags
def prune_command(dirpath: str, keep_last: int, keep_best: Optional[str], mode: Optional[str], dry_run: bool,
                  min_staging_age: str, force: bool, as_json: bool, endpoint_url: Optional[str],
                  region: Optional[str]) -> int:
    """Delete old snapshots of DIRPATH by the saver's retention rules.

    Only snapshots this plugin wrote (with its index) are deleted, never the newest complete one
    nor the one restore_from_latest would restore; symlinks are never followed; nothing else in
    DIRPATH is touched. Refused (exit status 2, naming the holder) while a live run holds
    DIRPATH: prune takes the run's lock itself, so no run starts while it deletes. --force prunes
    without the lock.
    """
    if (keep_best is None) != (mode is None):
        raise click.UsageError("--keep-best and --mode go together")
    min_age = duration(min_staging_age)
    store = open_target(dirpath, s3_options(endpoint_url, region))
    listing = list_directory(store)  # a missing or wrong dirpath: exit 2 before any lock is taken
    head, sep, name = dirpath.rstrip("/").rpartition("/")
    if holds_one_snapshot(name, listing):
        raise UsageProblem(
            f"{dirpath} is a snapshot, not a directory of snapshots; prune the directory holding it, "
            f"{(head or '/') if sep else '.'}"
        )
    lock = None
    if not force and not dry_run:
        lock = take_lock(store)
    try:
        return _prune(store, keep_last, keep_best, mode, dry_run, min_age, as_json)
    finally:
        if lock is not None:
            lock.release()


def take_lock(store: Store) -> Any:
    """The dirpath's lock (a saver's run takes the same), or UsageProblem naming its holder."""
    from tnt_snapshot_plugin.stores.ownership import holder_text, writer_identity

    holder = {**writer_identity("tnt-snapshot-prune"), "started_at": time.time()}
    try:
        return store.lock(holder)
    except ConfigError:
        found = lock_holder(store, LEASE_FNAME if isinstance(store, S3Store) else LOCK_FNAME)
        raise UsageProblem(
            f"refusing to prune {store.url}: a live run holds it ({holder_text(found)}); prune once it "
            "has ended, or pass --force to prune while it runs"
        ) from None


def _prune(store: Store, keep_last: int, keep_best: Optional[str], mode: Optional[str], dry_run: bool,
           min_age: float, as_json: bool) -> int:
    infos = survey(store)
    busy = _being_written(infos, min_age)
    if busy is not None:
        return fail("tnt-snapshot", f"refusing to prune {store.url}: {busy}", 1)
    candidates = [
        PruneCandidate(
            name=i.parsed,
            ours=i.index is not None and not i.parsed.phase_aware,
            complete=i.status in (STATUS_COMPLETE, STATUS_DAMAGED),
            seq=i.seq,
            metric=metric_value(i, keep_best) if keep_best else None,
        )
        for i in infos
        if i.kind == "snapshot" and i.parsed is not None
    ]
    pick = [i.name for i in infos if i.restore]
    verdict = select_for_pruning(candidates, keep_last=keep_last, keep_best=keep_best, mode=mode or "min", protect=pick)
    doomed = [name for name, reason in verdict.items() if reason is None]
    deleted: list[str] = []
    failed: list[str] = []
    if not dry_run:
        for name in doomed:
            try:
                listing.remove(store, name)
                deleted.append(name)
            except (OSError, SnapshotError) as exc:
                failed.append(f"{name}: {exc}")
    order = [i.name for i in infos if i.name in verdict]
    if as_json:
        emit_json({
            "dirpath": store.url,
            "dry_run": dry_run,
            "delete": doomed,
            "deleted": deleted,
            "failed": failed,
            "keep": [{"name": n, "reason": verdict[n]} for n in order if verdict[n] is not None],
            "untouched": [i.name for i in infos if i.name not in verdict],
            "damaged": {i.name: i.problems for i in infos if i.status == STATUS_DAMAGED},
        })
    else:
        _report(infos, order, verdict, doomed if dry_run else deleted, failed, dry_run)
    return 1 if failed else 0


def _being_written(infos: list[SnapshotInfo], min_age: float) -> Optional[str]:
    """Why a run may be writing in the directory (a staging directory or an incomplete snapshot
    of the plugin's younger than ``min_age`` seconds), or None."""
    now = time.time()
    for i in infos:
        writing = i.kind == "staging" or (
            i.kind == "snapshot" and i.status == STATUS_INCOMPLETE and i.parsed is not None and not i.parsed.phase_aware
        )
        age = now - i.modified_at if i.modified_at is not None else None
        if writing and age is not None and age < min_age:
            return (
                f"{i.name} was written to {age:.0f}s ago (younger than --min-staging-age {min_age:.0f}s), so a "
                "run may be writing; stop it, or pass a smaller --min-staging-age once no run writes here"
            )
    return None


def _report(infos: list[SnapshotInfo], order: list[str], verdict: dict[str, Optional[str]], gone: list[str],
            failed: list[str], dry_run: bool) -> None:
    out = console()
    table = new_table("SNAPSHOT", "ACTION", "WHY")
    sizes = {i.name: i.nbytes for i in infos}
    for name in order:
        reason = verdict[name]
        action = Text("keep", style="green") if reason is not None else Text(
            "would delete" if dry_run else ("deleted" if name in gone else "FAILED"), style="red")
        table.add_row(name, action, reason or f"older than the kept ones ({human_size(sizes[name])})")
    print_table(out, table)
    for i in infos:
        for problem in i.problems if i.status == STATUS_DAMAGED else ():
            say(out, f"{i.name}: {problem}", style="red")
    others = [i.name for i in infos if i.name not in verdict]
    if others:
        say(out, f"not snapshots, left alone: {', '.join(others)}")
    freed = sum(sizes[n] for n in gone)
    say(out, f"{'would delete' if dry_run else 'deleted'} {len(gone)} snapshots, {human_size(freed)}")
    for line in failed:
        say(out, f"could not delete {line}", style="red")
