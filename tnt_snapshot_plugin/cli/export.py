"""``tnt-snapshot export``: a snapshot's model weights as a torch.save file or safetensors (what is
written, and how: ``weights.py``)."""

from __future__ import annotations

import os
from typing import Optional

import click
from rich.filesize import decimal as human_size

from tnt_snapshot_plugin.cli.app import (
    UsageProblem,
    cli,
    json_flag,
    path_argument,
    s3_flags,
    s3_options,
    split_target,
)
from tnt_snapshot_plugin.cli.entries import Snapshot
from tnt_snapshot_plugin.cli.output import console, emit_json, say
from tnt_snapshot_plugin.cli.weights import require_safetensors, weights, write_safetensors, write_torch


@cli.command("export")
@path_argument("snapshot")
@path_argument("out_path", metavar="OUT")
@click.option("--key", default=None, help="The entry to export (default: the one entry holding only tensors).")
@click.option("--format", "fmt", type=click.Choice(["auto", "torch", "safetensors"]), default="auto", show_default=True,
              help="auto: safetensors if OUT ends in .safetensors, else torch.save.")
@click.option("--force", is_flag=True, help="Overwrite OUT if it exists.")
@json_flag
@s3_flags
def export_command(snapshot: str, out_path: str, key: Optional[str], fmt: str, force: bool, as_json: bool,
                   endpoint_url: Optional[str], region: Optional[str]) -> int:
    """Write SNAPSHOT's model weights to OUT, for inference without the trainer.

    As a torch.save'd state dict (load with torch.load(OUT) and module.load_state_dict) or as
    safetensors. KEY may name a sub-entry: 'state_dict' or 'model/0.weight'. An entry holding
    tensors and other values (an optimizer's state) is written whole with torch.save; an entry
    holding no tensor is refused. OUT is written whole or not at all. A snapshot that restore's
    check finds damaged is refused (exit status 2), as verify reports it.
    """
    opts = s3_options(endpoint_url, region)
    _check_out(out_path, force)
    store, name = split_target(snapshot, opts)
    if fmt == "auto":
        fmt = "safetensors" if out_path.endswith(".safetensors") else "torch"
    if fmt == "safetensors":
        require_safetensors("--format safetensors")
    snap = Snapshot(store, name, decode_objects=False)  # a damaged snapshot is refused, as restore refuses it
    found = weights(snap, key, tensors_only=fmt == "safetensors", command="export", instead="--format torch")
    about = {"source": store.child(name), "key": found.key}
    if fmt == "safetensors":
        write_safetensors(out_path, found.tensors, about)
    else:
        write_torch(out_path, found.value)
    tensors, others, nbytes = found.tensors, found.others, found.nbytes
    if as_json:
        emit_json({"snapshot": store.child(name), "key": found.key, "out": out_path, "format": fmt,
                   "tensors": len(tensors), "bytes": nbytes, "other_values": len(others)})
    else:
        also = f"; {len(others)} other values" if others else ""
        say(console(), f"exported {found.key} ({len(tensors)} tensors, {human_size(nbytes)}{also}) from "
                         f"{store.child(name)} to {out_path} ({'safetensors' if fmt == 'safetensors' else 'torch.save'})")
    return 0


def _check_out(out_path: str, force: bool) -> None:
    """OUT names a file export can write: a local path, in a folder that exists, not a folder
    itself, and not an existing file unless ``force``."""
    if "://" in out_path:
        raise UsageProblem(f"OUT {out_path!r} is a URL; export writes a local file: name a local path")
    folder = os.path.dirname(os.path.abspath(out_path))
    if out_path.endswith(os.sep) or os.path.isdir(out_path):
        raise UsageProblem(f"OUT {out_path} is a folder; name a file in it, e.g. {os.path.join(out_path, 'model.pt')}")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise UsageProblem(f"the folder of OUT, {folder}, {what}; create it, or name a file in a folder that exists")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageProblem(f"the folder of OUT, {folder}, is not writable")
    if os.path.lexists(out_path) and not force:
        raise UsageProblem(f"{out_path} exists; pass --force to overwrite it")
