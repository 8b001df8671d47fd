"""``tnt-snapshot verify``: every file of a snapshot, or of every snapshot in a directory, checked
as restore checks it."""

from __future__ import annotations

import os
from typing import Optional

from rich.filesize import decimal as human_size
from rich.text import Text

from tnt_snapshot_plugin.cli.app import (
    cli,
    json_flag,
    open_target,
    path_argument,
    s3_flags,
    s3_options,
    split_target,
)
from tnt_snapshot_plugin.cli.output import (
    STATUS_COMPLETE,
    STATUS_DAMAGED,
    STATUS_INCOMPLETE,
    STATUS_STYLE,
    Progress,
    console,
    emit_json,
    new_table,
    print_table,
    say,
)
from tnt_snapshot_plugin.cli.survey import SnapshotInfo, snapshot_info, survey
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.naming import SnapshotName


@cli.command("verify")
@path_argument("target")
@json_flag
@s3_flags
def verify_command(target: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Check every file of a snapshot, or of every snapshot in a directory.

    The check restore makes: the index (sealed) and the sizes it records, the metadata (as
    restore parses it) and the files it reads, and every checksum the snapshot recorded. Exit
    status 1 when anything is damaged (or a snapshot given by path is incomplete), naming each
    damaged file.
    """
    opts = s3_options(endpoint_url, region)
    single = SnapshotName.parse(target.rstrip("/").rpartition("/")[2]) is not None or target.rstrip("/").endswith(
        tuple(metadata_files())
    )
    if not single and "://" not in target and any(os.path.isfile(os.path.join(target, m)) for m in metadata_files()):
        single = True
    err = console(err=True)
    with Progress(err, enabled=err.is_terminal and not as_json) as advance:
        if single:
            infos = [snapshot_info(*split_target(target, opts), checksums=True, progress=advance)]
        else:
            infos = [i for i in survey(open_target(target, opts), checksums=True, progress=advance) if i.kind == "snapshot"]
    bad = [i for i in infos if i.status == STATUS_DAMAGED or (single and i.status == STATUS_INCOMPLETE)]
    if as_json:
        emit_json({
            "target": target,
            "ok": not bad,
            "restore": next((i.name for i in infos if i.restore), None),
            "snapshots": [
                {"name": i.name, "status": i.status, "files": len(i.files), "bytes": i.nbytes,
                 "checked": _checked(i), "problems": i.problems, "note": i.note}
                for i in infos
            ],
        })
    else:
        _report(target, infos, bad, single)
    return 1 if bad else 0


def no_checksums(names: list[str], among: int) -> str:
    """The line saying that snapshots ``names`` (of ``among``) hold no checksums."""
    if among == 1:
        return ("no checksums: this snapshot was not written by this plugin; its files' sizes and its "
                "metadata's consistency are checked")
    return (f"no checksums in {len(names)} of these snapshots (not written by this plugin): their files' "
            "sizes and their metadata's consistency are checked")


def _checked(i: SnapshotInfo) -> str:
    if i.status == STATUS_INCOMPLETE:
        return "-"
    return "sizes+checksums" if (i.index or {}).get("checksums") else "sizes"


def _report(target: str, infos: list[SnapshotInfo], bad: list[SnapshotInfo], single: bool) -> None:
    out = console()
    table = new_table("SNAPSHOT", "FILES", "SIZE", "CHECKED", "STATUS", right=("FILES", "SIZE"))
    for i in infos:
        status = Text("intact" if i.status == STATUS_COMPLETE else i.status, style=STATUS_STYLE[i.status])
        if i.restore:
            status.append(" *", style="bold")
        table.add_row(i.name, str(len(i.files)), human_size(i.nbytes), _checked(i), status)
    print_table(out, table)
    for i in infos:
        for problem in i.problems:
            say(out, f"{i.name}: {problem}", style="red")
    for i in infos:
        for note in i.note.split("; ") if i.note and not i.without_checksums else ():
            say(out, f"{i.name}: {note}")
    unchecked = [i.name for i in infos if i.without_checksums]
    if unchecked:
        say(out, no_checksums(unchecked, len(infos)))
    if not infos:
        say(out, f"no snapshots in {target}")
    if not single:
        pick = next((i.name for i in infos if i.restore), None)
        say(out, f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    if infos:
        say(out, f"{len(bad)} damaged" if bad else "all intact")
