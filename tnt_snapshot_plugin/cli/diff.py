"""``tnt-snapshot diff``: the entries added, removed or changed from one snapshot to another."""

from __future__ import annotations

from typing import Optional

import click
from rich.text import Text

from tnt_snapshot_plugin.cli.app import cli, json_flag, s3_flags, s3_options, split_target
from tnt_snapshot_plugin.cli.entries import diff_snapshots
from tnt_snapshot_plugin.cli.output import console, emit_json, new_table, print_table, say


@cli.command("diff")
@click.argument("a")
@click.argument("b")
@json_flag
@s3_flags
def diff_command(a: str, b: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Entries added, removed or changed from snapshot A to snapshot B.

    Tensors are compared by their bytes, and those that differ by max |a-b|; a sharded tensor
    (ShardedTensor, DTensor) whole, once, under the first rank that records it; opaque state (RNG
    generators, objects) as "differs". Exit status 0 when the snapshots hold the same values, 1
    when they differ, 2 when either is damaged (the check restore makes, as verify reports it).
    """
    opts = s3_options(endpoint_url, region)
    sides = split_target(a, opts), split_target(b, opts)
    diffs, compared = diff_snapshots(*sides, opts)
    if as_json:
        emit_json({"a": a, "b": b, "entries_compared": compared, "identical": not diffs, "differences": diffs})
        return 1 if diffs else 0
    out = console()
    if diffs:
        table = new_table("KEY", "CHANGE", "DETAIL")
        style = {"added": "green", "removed": "red", "changed": "yellow"}
        for d in diffs:
            table.add_row(d["path"], Text(d["change"], style=style[d["change"]]), d["detail"])
        print_table(out, table)
    counts: dict[str, int] = {}
    for d in diffs:
        counts[d["change"]] = counts.get(d["change"], 0) + 1
    say(out, f"{compared} entries compared: {compared - len(diffs)} identical"
         + "".join(f", {n} {c}" for c, n in counts.items()))
    return 1 if diffs else 0
