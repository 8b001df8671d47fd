"""``tnt-snapshot export``: a snapshot's model weights as a torch.save file or safetensors."""

from __future__ import annotations

import os
from typing import Any, Optional

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
from tnt_snapshot_plugin.cli.entries import Snapshot, tensor_keys, tensor_leaves, weight_keys
from tnt_snapshot_plugin.cli.output import console, emit_json, say
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.stores import fileio


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
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ConfigError("--format safetensors needs safetensors: pip install 'tnt-snapshot-plugin[cli]'") from None
    snap = Snapshot(store, name)  # a damaged snapshot is refused, as restore refuses it
    key, value = _entry_value(snap, key)
    import torch

    if isinstance(value, torch.Tensor):
        value = {key.rstrip("/").rpartition("/")[2]: value}
    tensors, others = tensor_leaves(value)
    if not tensors:
        holding = tensor_keys(snap)
        raise UsageProblem(
            f"entry {key!r} of {store.child(name)} holds no tensors ({len(others)} other values); export "
            f"writes tensors: choose a --key that holds them ({', '.join(holding) or 'none in this snapshot'})"
        )
    if fmt == "safetensors" and others:
        raise UsageProblem(
            f"cannot export {key!r} as safetensors: {others[0] or 'the entry'} is not a tensor (safetensors "
            f"holds tensors only, and {key!r} holds {len(others)} other values); write it with --format torch, "
            f"or choose a --key holding only tensors ({', '.join(weight_keys(snap)) or 'none in this snapshot'})"
        )
    _write(out_path, fmt, value, tensors, {"source": store.child(name), "key": key})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if as_json:
        emit_json({"snapshot": store.child(name), "key": key, "out": out_path, "format": fmt,
                   "tensors": len(tensors), "bytes": nbytes, "other_values": len(others)})
    else:
        also = f"; {len(others)} other values" if others else ""
        say(console(), f"exported {key} ({len(tensors)} tensors, {human_size(nbytes)}{also}) from "
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


def _entry_value(snap: Snapshot, key: Optional[str]) -> tuple[str, Any]:
    """(the key exported, its value): ``key`` (a top-level entry, or a path below one), or the one
    top-level entry holding only tensors."""
    store, name = snap.store, snap.name
    top = snap.top_keys()
    if key is None:
        found = weight_keys(snap)
        if len(found) != 1:
            raise UsageProblem(
                f"{store.child(name)} has {len(found)} entries holding only tensors ({', '.join(found) or 'none'}); "
                f"choose one with --key (entries: {', '.join(sorted(top))})"
            )
        key = found[0]
    head, _, sub = key.strip("/").partition("/")
    if head not in top:
        raise UsageProblem(f"{store.child(name)} has no entry {head!r} (entries: {', '.join(sorted(top))})")
    value = snap.key(head)
    for part in [p for p in sub.split("/") if p]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise UsageProblem(f"entry {head!r} of {store.child(name)} has no {sub!r}")
    return key, value


def _write(out_path: str, fmt: str, value: Any, tensors: dict[str, Any], about: dict[str, str]) -> None:
    """``value`` (torch.save) or ``tensors`` (safetensors) to ``out_path``, whole or not at all: written
    to a temporary file beside it, flushed to disk, then renamed over it. A failure leaves no
    part of a file behind (click.ClickException, exit status 1)."""
    import torch

    directory = os.path.dirname(os.path.abspath(out_path))
    tmp = os.path.join(directory, f".{os.path.basename(out_path)}.tmp.{os.getpid()}")
    # torch.save reports a failed write as a RuntimeError, safetensors as its SafetensorError
    failures: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    try:
        if fmt == "safetensors":
            from safetensors import SafetensorError
            from safetensors.torch import save_file

            failures += (SafetensorError,)
            save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp, metadata=about)
        else:
            with open(tmp, "wb") as f:  # through a Python file: a failed write is an OSError naming its cause
                torch.save(value, f)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out_path)
    except failures as exc:
        raise click.ClickException(f"could not write {out_path} ({exc}); nothing was written") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fileio.fsync_dir(directory)
