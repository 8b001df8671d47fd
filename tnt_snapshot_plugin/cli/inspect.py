"""``tnt-snapshot inspect``: every entry of one snapshot."""

from __future__ import annotations

from typing import Optional

import click
from rich.filesize import decimal as human_size

from ..naming import SnapshotName
from ..stores import INDEX_FNAME
from .app import cli, json_flag, s3_flags, s3_options, split_target
from .entries import checked_metadata, entry_rows, summarize, summary_lines
from .output import console, emit_json, new_table, num, print_table, say
from .survey import snapshot_files


@cli.command("inspect")
@click.argument("snapshot")
@json_flag
@s3_flags
def inspect_command(snapshot: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Every entry of SNAPSHOT: key path, kind, dtype, shape, bytes, replicated."""
    store, name = split_target(snapshot, s3_options(endpoint_url, region))
    files, _ = snapshot_files(store, name)
    metadata, checked = checked_metadata(store, name)
    index = checked or {}
    rows = entry_rows(metadata, files)
    summary = summarize(metadata)
    parsed = SnapshotName.parse(name)
    head = {
        "snapshot": store.child(name),
        "epoch": index.get("epoch", parsed.epoch if parsed else None),
        "step": index.get("step", parsed.step if parsed else None),
        "world_size": index.get("world_size", metadata.world_size),
        "bytes": sum(f.size for f in files.values()),
        "files": len(files),
        "writer": "tnt_snapshot_plugin" if INDEX_FNAME in files else ("torchtnt" if parsed and parsed.phase_aware else None),
    }
    if as_json:
        emit_json({**head, "summary": summary, "entries": rows})
        return 0
    out = console()
    say(out,
         f"{head['snapshot']}: epoch {num(head['epoch'])}, step {num(head['step'])}, world size "
         f"{num(head['world_size'])}, {human_size(int(head['bytes'] or 0))} in {head['files']} files")
    for line in summary_lines(summary):
        say(out, line)
    table = new_table("KEY", "KIND", "DTYPE", "SHAPE/VALUE", "BYTES", "REPLICATED", right=("BYTES",))
    shapes: dict[tuple[int, ...], str] = {(): "scalar"}  # a model has few distinct shapes and sizes
    sizes: dict[int, str] = {0: "-"}
    for r in rows:
        if r["shape"] is not None:
            key = tuple(r["shape"])
            shape = shapes.get(key) or shapes.setdefault(key, "x".join(map(str, key)))
        else:
            shape = "=" + repr(r["value"]) if r["kind"] == "value" else ""
        nbytes = r["bytes"]
        size = sizes.get(nbytes) or sizes.setdefault(nbytes, human_size(nbytes))
        table.add_row(r["path"], r["kind"], str(r["dtype"] or ""), shape, size, "yes" if r["replicated"] else "no")
    print_table(out, table)
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    say(out, f"{len(rows)} entries: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))
    return 0
