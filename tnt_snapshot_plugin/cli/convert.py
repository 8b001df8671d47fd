"""``tnt-snapshot convert``: a snapshot in the other on-disk format, or its model weights as a
``torch.save`` file or Hugging Face safetensors.

``--to torchsnapshot|dcp``: every entry of every saved rank, written as a new snapshot
(``conversion.py``: how, and what is refused).

``--to torch|safetensors``: the model weights, as ``export`` writes them (``weights.py``);
safetensors in Hugging Face's layout, sharded above ``--max-shard-size``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import click
from rich.filesize import decimal as human_size

from tnt_snapshot_plugin.cli.app import (
    UsageProblem,
    cli,
    json_flag,
    open_target,
    path_argument,
    s3_flags,
    s3_options,
    split_path,
    split_target,
)
from tnt_snapshot_plugin.cli.entries import Snapshot
from tnt_snapshot_plugin.cli.output import Progress, console, emit_json, say
from tnt_snapshot_plugin.cli.weights import (
    DEFAULT_MAX_SHARD,
    parse_size,
    require_safetensors,
    weights,
    write_safetensors_dir,
    write_torch,
)
from tnt_snapshot_plugin.naming import SnapshotName
from tnt_snapshot_plugin.stores import LocalStore, Store

#: The snapshot formats convert writes; the other targets write model weights.
SNAPSHOT_FORMATS = ("torchsnapshot", "dcp")
#: A conversion of this many bytes or more shows a progress bar (on a terminal).
PROGRESS_BYTES = 64 << 20


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command("convert")
@path_argument("src")
@path_argument("dst")
@click.option("--to", "target", type=click.Choice([*SNAPSHOT_FORMATS, "torch", "safetensors"]), required=True,
              help="torchsnapshot or dcp: a snapshot in that format; torch or safetensors: the model weights.")
@click.option("--key", default=None,
              help="With --to torch or safetensors: the entry written (default: the one entry holding only tensors).")
@click.option("--max-shard-size", default=DEFAULT_MAX_SHARD, show_default=True, callback=_size, metavar="SIZE",
              help="With --to safetensors: the largest file (5GB, 500MB, 2GiB); above it, shards and an index.")
@click.option("--quiet", is_flag=True, help="Print nothing but errors (no progress bar, no summary).")
@json_flag
@s3_flags
def convert_command(src: str, dst: str, target: str, key: Optional[str], max_shard_size: int, quiet: bool,
                    as_json: bool, endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Write snapshot SRC to DST in another format.

    --to torchsnapshot or dcp: DST is a new snapshot (named like one, e.g. out/epoch_0_step_4)
    holding every entry of every rank of SRC, which restore, restore_from_latest and the target
    format's own reader (torchsnapshot, torch.distributed.checkpoint) read. --to torch: DST is a
    torch.save file of the model weights; --to safetensors: DST is a new folder of them in Hugging
    Face's layout (model.safetensors, or shards and model.safetensors.index.json above
    --max-shard-size). DST is written whole or not at all; a DST that exists is refused. A
    snapshot that restore's check finds damaged is refused (exit status 2), as verify reports it.
    """
    opts = s3_options(endpoint_url, region)
    if target in SNAPSHOT_FORMATS:
        if key is not None:
            raise UsageProblem(f"--key applies to --to torch and --to safetensors; --to {target} converts every entry")
        dst_store, dst_name = _new_snapshot(dst, src, opts)
    else:
        _new_local_path(dst, target)
        if target == "safetensors":
            require_safetensors("--to safetensors")
    store, name = split_target(src, opts)
    snap = Snapshot(store, name, decode_objects=False)  # a damaged snapshot is refused, as restore refuses it
    err = console(err=True)
    total = sum(info.nbytes or 0 for info in snap.entries.values())
    progress = Progress(err, enabled=err.is_terminal and not (quiet or as_json) and total >= PROGRESS_BYTES,
                        label="reading", total=total)
    source = {"src": store.child(name), "from": snap.format.name, "to": target}
    if target in SNAPSHOT_FORMATS:
        from tnt_snapshot_plugin.cli.conversion import convert_snapshot  # torch from here on

        with progress as advance:
            done = convert_snapshot(snap, dst_store, dst_name, target, advance=advance, stage=progress.stage)
        for warning in done.warnings:
            click.echo(f"tnt-snapshot: warning: {warning}", err=True)
        if as_json:
            emit_json({**source, "dst": dst_store.child(dst_name.text), "world_size": done.world_size,
                       "keys": done.keys, "bytes": done.nbytes})
        elif not quiet:
            say(console(), f"converted {store.child(name)} ({snap.format.name}, {_ranks(done.world_size)}, "
                           f"{done.keys} entries) to {dst_store.child(dst_name.text)} ({target}, {human_size(done.nbytes)})")
        return 0
    with progress as advance:
        found = weights(snap, key, tensors_only=target == "safetensors", command="convert", instead="--to torch")
        progress.stage("writing", found.nbytes)
        about = {"source": store.child(name), "key": found.key}
        if target == "safetensors":
            written = write_safetensors_dir(dst, found.tensors, about, max_shard_size, advance)
        else:
            write_torch(dst, found.value)
            written = [os.path.basename(dst)]
    if as_json:
        emit_json({**source, "dst": dst, "key": found.key, "tensors": len(found.tensors), "bytes": found.nbytes,
                   "files": written, "other_values": len(found.others)})
    elif not quiet:
        files = f"{len(written)} files" if len(written) > 1 else written[0]
        also = f"; {len(found.others)} other values" if found.others else ""
        say(console(), f"wrote {found.key} ({len(found.tensors)} tensors, {human_size(found.nbytes)}{also}) of "
                       f"{store.child(name)} to {dst} ({target}: {files})")
    return 0


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _new_snapshot(dst: str, src: str, opts: Optional[dict[str, Any]]) -> tuple[Store, SnapshotName]:
    """The store and name of the new snapshot DST: named like a snapshot, not there yet."""
    head, name = split_path(dst)
    parsed = SnapshotName.parse(name)
    if parsed is None:
        src_name = split_path(src)[1]
        example = src_name if SnapshotName.parse(src_name) is not None else "epoch_0_step_0"
        raise UsageProblem(
            f"DST {dst!r} is not named like a snapshot (epoch_E_step_S), which restore_from_latest looks "
            f"for: name it so, e.g. {head.rstrip('/')}/{example}"
        )
    store = open_target(head, opts)
    if _exists(store, name):
        raise UsageProblem(f"DST {store.child(name)} exists; convert writes a new snapshot: name another DST, or remove it")
    _writable(store)
    return store, parsed


def _writable(store: Store) -> None:
    """UsageProblem (ConfigError elsewhere) if DST's directory cannot be written; nothing is
    created meanwhile (on local disk: the nearest folder that exists is asked)."""
    if not isinstance(store, LocalStore):
        store.check_writable()
        return
    folder = store.root
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise UsageProblem(f"{folder} is not a folder, so DST's folder {store.url} cannot be made")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageProblem(f"{folder} is not writable, so DST cannot be written in {store.url}")


def _exists(store: Store, name: str) -> bool:
    if isinstance(store, LocalStore):
        return os.path.lexists(os.path.join(store.root, name))
    return name in store.list_names()


def _new_local_path(dst: str, target: str) -> None:
    """DST names a local file (torch) or folder (safetensors) that can be made."""
    what = "file" if target == "torch" else "folder"
    if "://" in dst:
        raise UsageProblem(f"DST {dst!r} is a URL; --to {target} writes a local {what}: name a local path")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        state = "is not a folder" if os.path.exists(parent) else "does not exist"
        raise UsageProblem(f"the folder of DST, {parent}, {state}; create it, or name a path in a folder that exists")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageProblem(f"the folder of DST, {parent}, is not writable")
    if os.path.lexists(dst):
        raise UsageProblem(f"DST {dst} exists; convert writes a new {what}: name another DST, or remove it")


__all__ = ["convert_command"]
