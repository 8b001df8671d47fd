"""``tnt-snapshot ls``: one row per entry of a snapshot directory, and the snapshot restore picks."""

from __future__ import annotations

from typing import Optional

import click
from rich.filesize import decimal as human_size
from rich.text import Text

from .app import cli, json_flag, open_target, s3_flags, s3_options
from .output import (
    STATUS_INCOMPLETE,
    STATUS_STYLE,
    console,
    emit_json,
    new_table,
    num,
    print_table,
    say,
    when,
)
from .survey import survey


@cli.command("ls")
@click.argument("dirpath")
@json_flag
@s3_flags
def ls_command(dirpath: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """One row per entry of DIRPATH, oldest snapshot first.

    Status: complete, damaged (its index, a file or the metadata missing, of the wrong size or
    unreadable; or, for the snapshot restore would pick, a payload that differs from its
    checksum), incomplete (no .snapshot_metadata), staging leftover, or foreign (not a
    snapshot: never touched). '*' marks the snapshot restore_from_latest would restore: the same
    check decides both.
    """
    store = open_target(dirpath, s3_options(endpoint_url, region))
    infos = survey(store)
    if as_json:
        pick = next((i.name for i in infos if i.restore), None)
        emit_json({"dirpath": store.url, "restore": pick, "entries": [i.to_json() for i in infos]})
        return 0
    out = console()
    table = new_table("NAME", "EPOCH", "STEP", "WORLD", "SIZE", "FILES", "COMMITTED", "STATUS",
                   right=("EPOCH", "STEP", "WORLD", "SIZE", "FILES"))
    for i in infos:
        p = i.parsed
        status = Text(i.status, style=STATUS_STYLE[i.status])
        if i.restore:
            status.append(" *", style="bold")
        size = human_size(i.nbytes) if i.kind != "foreign" or i.files else "-"
        table.add_row(
            i.name, num(p.epoch if p else None), num(p.step if p else None), num(i.world_size),
            size, str(len(i.files)) if i.kind != "foreign" or i.files else "-",
            when(i.committed_at) if i.kind == "snapshot" and i.status != STATUS_INCOMPLETE else "-",
            status,
        )
    print_table(out, table)
    for i in infos:
        for problem in i.problems:
            say(out, f"{i.name}: {problem}", style="red")
    counts: dict[str, int] = {}
    for i in infos:
        counts[i.status] = counts.get(i.status, 0) + 1
    total = sum(i.nbytes for i in infos if i.kind == "snapshot")
    parts = [f"{n} {s}" for s, n in counts.items()]
    pick = next((i.name for i in infos if i.restore), None)
    say(out, f"{', '.join(parts) or 'empty'}; {human_size(total)} in snapshots")
    say(out, f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    return 0
