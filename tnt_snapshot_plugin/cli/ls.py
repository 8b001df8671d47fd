"""``tnt-snapshot ls``: one row per entry of a snapshot directory, and the snapshot restore picks."""

from __future__ import annotations

from typing import Any, Optional

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
from tnt_snapshot_plugin.cli.survey import (
    file_role,
    holder_state,
    holds_one_snapshot,
    list_directory,
    snapshot_info,
    survey,
)
from tnt_snapshot_plugin.format.registry import metadata_files


@cli.command("ls")
@path_argument("dirpath")
@json_flag
@s3_flags
def ls_command(dirpath: str, as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """One row per entry of DIRPATH, oldest snapshot first; given one snapshot, its files.

    Status: complete, damaged (its index, a file or the metadata missing, of the wrong size or
    unreadable; or, for the snapshot restore would pick, a payload that differs from its
    checksum), incomplete (no .snapshot_metadata), staging leftover, lock (a saver's lock or
    lease, with its holder), or foreign (not a snapshot: never touched). '*' marks the snapshot
    restore_from_latest would restore: the same check decides both.
    """
    opts = s3_options(endpoint_url, region)
    if dirpath.rstrip("/").endswith(tuple("/" + m for m in metadata_files())):  # a snapshot's metadata: that snapshot
        return _ls_snapshot(dirpath, opts, as_json)
    store = open_target(dirpath, opts)
    listing = list_directory(store)
    if holds_one_snapshot(dirpath.rstrip("/").rpartition("/")[2], listing):
        return _ls_snapshot(dirpath, opts, as_json)
    infos = survey(store, listing=listing)
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
        if i.kind == "lock":
            status.append(f", {holder_state(i.holder)}")
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
    unchecked = [i.name for i in infos if i.without_checksums]
    if unchecked:
        say(out, f"no checksums in {', '.join(unchecked[:3])}{' and more' if len(unchecked) > 3 else ''} "
                 "(not written by this plugin): verify checks their files' sizes and their metadata's consistency")
    say(out, f"{', '.join(parts) or 'empty'}; {human_size(total)} in snapshots")
    say(out, f"* restore_from_latest would restore {pick}" if pick else "restore_from_latest would find nothing to restore")
    return 0


def _ls_snapshot(target: str, opts: Optional[dict[str, Any]], as_json: bool) -> int:
    """``ls`` of one snapshot: its files, what each is, and the snapshot's status."""
    store, name = split_target(target, opts)
    info = snapshot_info(store, name, checksums=False)
    rows = [(rel, file_role(rel), f) for rel, f in sorted(info.files.items())]
    if as_json:
        emit_json({
            "snapshot": store.child(name),
            "entry": {k: v for k, v in info.to_json().items() if k not in ("restore", "holder")},
            "files": [{"path": rel, "role": role, "bytes": f.size, "modified_at": f.mtime} for rel, role, f in rows],
        })
        return 0
    out = console()
    table = new_table("FILE", "ROLE", "SIZE", "MODIFIED", right=("SIZE",))
    for rel, role, f in rows:
        table.add_row(rel, role, human_size(f.size), when(f.mtime))
    print_table(out, table)
    for problem in info.problems:
        say(out, f"{name}: {problem}", style="red")
    p = info.parsed
    about = [f"epoch {num(p.epoch)}, step {num(p.step)}"] if p is not None else []
    if info.world_size is not None:
        about.append(f"world size {info.world_size}")
    if info.committed_at is not None:
        about.append(f"committed {when(info.committed_at)}")
    if info.without_checksums:
        about.append("no checksums (not written by this plugin): its files' sizes and metadata are checked")
    say(out, f"{store.child(name)}: {info.status}; {len(rows)} files, {human_size(info.nbytes)}"
             + "".join(f"; {a}" for a in about))
    return 0
