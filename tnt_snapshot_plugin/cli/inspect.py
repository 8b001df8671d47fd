"""``tnt-snapshot inspect``: every entry of one snapshot."""

from __future__ import annotations

from typing import Iterator, Optional

import click
from rich.filesize import decimal as human_size

from tnt_snapshot_plugin.cli.app import cli, json_flag, s3_flags, s3_options, split_target
from tnt_snapshot_plugin.cli.entries import Snapshot, entry_row, entry_rows, summarize, summary_lines
from tnt_snapshot_plugin.cli.output import console, emit_json, new_table, num, print_table, say
from tnt_snapshot_plugin.cli.survey import FileInfo, snapshot_files
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.naming import SnapshotName


@cli.command("inspect")
@click.argument("target", metavar="SNAPSHOT")
@json_flag
@s3_flags
def inspect_command(target: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Every entry of SNAPSHOT: key path, kind, dtype, shape, bytes, replicated."""
    store, name = split_target(target, s3_options(endpoint_url, region))
    files, _ = snapshot_files(store, name)
    snap = Snapshot(store, name)
    recorded = snap.index or {}
    summary = summarize(snap)
    parsed = SnapshotName.parse(name)
    head = {
        "snapshot": store.child(name),
        "epoch": recorded.get("epoch", parsed.epoch if parsed else None),
        "step": recorded.get("step", parsed.step if parsed else None),
        "world_size": recorded.get("world_size", snap.world_size),
        "format": snap.format.name,
        "bytes": sum(f.size for f in files.values()),
        "files": len(files),
        "writer": "tnt_snapshot_plugin" if INDEX_FNAME in files else ("torchtnt" if parsed and parsed.phase_aware else None),
    }
    if as_json:
        emit_json({**head, "summary": summary, "entries": entry_rows(snap, files)})
        return 0
    out = console()
    say(out,
         f"{head['snapshot']}: epoch {num(head['epoch'])}, step {num(head['step'])}, world size "
         f"{num(head['world_size'])}, {human_size(int(head['bytes'] or 0))} in {head['files']} files")
    for line in summary_lines(summary):
        say(out, line)
    table = new_table("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "BYTES", "REPLICATED", right=("BYTES",))
    table.extend(_text_rows(snap, files))
    print_table(out, table)
    kinds: dict[str, int] = {}
    for row in table.rows:
        kinds[row[1]] = kinds.get(row[1], 0) + 1
    say(out, f"{len(table.rows)} entries: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return 0


def _text_rows(snapshot: Snapshot, files: dict[str, FileInfo]) -> Iterator[tuple[str, ...]]:
    """The cells of each leaf entry, sorted by path: what ``entry_rows`` holds, as text."""
    shapes: dict[tuple[int, ...], str] = {(): "scalar"}  # a model has few distinct shapes and sizes
    sizes: dict[int, str] = {0: "-"}
    entries = snapshot.entries
    for path in sorted(entries):
        row = entry_row(path, entries[path], files)
        if row["shape"] is not None:
            key = tuple(row["shape"])
            shape = shapes.get(key) or shapes.setdefault(key, "x".join(map(str, key)))
        else:
            shape = "=" + repr(row["value"]) if row["kind"] == "value" else ""
        nbytes = row["bytes"]
        size = sizes.get(nbytes) or sizes.setdefault(nbytes, human_size(nbytes))
        yield path, row["kind"], str(row["dtype"] or ""), shape, size, "yes" if row["replicated"] else "no"
