"""``tnt-snapshot export``: a snapshot's model weights as a torch.save file or safetensors."""

from __future__ import annotations

import os
from typing import Any, Optional

import click
from rich.filesize import decimal as human_size

from ..errors import ConfigError
from ..stores import Store
from ..verify import require_intact
from .app import UsageProblem, cli, json_flag, s3_flags, s3_options, split_target
from .entries import flatten_tensors, load_entry, require_metadata, weight_keys
from .output import console, emit_json, say


@cli.command("export")
@click.argument("snapshot")
@click.argument("out_path", metavar="OUT")
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
    safetensors. KEY may name a sub-entry: 'state_dict' or 'model/0.weight'. A snapshot that the
    check restore makes finds damaged is refused (exit status 2), as verify reports it.
    """
    opts = s3_options(endpoint_url, region)
    store, name = split_target(snapshot, opts)
    if fmt == "auto":
        fmt = "safetensors" if out_path.endswith(".safetensors") else "torch"
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ConfigError("--format safetensors needs safetensors: pip install 'tnt-snapshot-plugin[cli]'") from None
    if os.path.exists(out_path) and not force:
        raise UsageProblem(f"{out_path} exists; pass --force to overwrite it")
    key, value = _entry_value(store, name, key, opts)
    import torch

    if isinstance(value, torch.Tensor):
        value = {key.rstrip("/").rpartition("/")[2]: value}
    try:
        tensors = flatten_tensors(value)
    except ValueError as exc:
        if fmt == "safetensors":
            raise UsageProblem(f"cannot export {key!r} as safetensors: {exc}; choose a key holding only tensors") from None
        tensors = {}
    _write(out_path, fmt, value, tensors, {"source": store.child(name), "key": key})
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if as_json:
        emit_json({"snapshot": store.child(name), "key": key, "out": out_path, "format": fmt,
                    "tensors": len(tensors), "bytes": nbytes})
    else:
        say(console(), f"exported {key} ({len(tensors)} tensors, {human_size(nbytes)}) from "
                         f"{store.child(name)} to {out_path} ({'safetensors' if fmt == 'safetensors' else 'torch.save'})")
    return 0


def _entry_value(store: Store, name: str, key: Optional[str], opts: Optional[dict[str, Any]]) -> tuple[str, Any]:
    """(the key exported, its value): ``key`` (a top-level entry, or a path below one), or the one
    top-level entry holding only tensors."""
    metadata = require_metadata(store, name)
    require_intact(store, name)  # a damaged snapshot is refused, as restore refuses it
    top = {p.split("/")[1] for p in metadata.manifest if p.startswith("0/")}
    if key is None:
        found = weight_keys(metadata)
        if len(found) != 1:
            raise UsageProblem(
                f"{store.child(name)} has {len(found)} entries holding only tensors ({', '.join(found) or 'none'}); "
                f"choose one with --key (entries: {', '.join(sorted(top))})"
            )
        key = found[0]
    head, _, sub = key.strip("/").partition("/")
    if head not in top:
        raise UsageProblem(f"{store.child(name)} has no entry {head!r} (entries: {', '.join(sorted(top))})")
    value = load_entry(store, name, head, opts)
    for part in [p for p in sub.split("/") if p]:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, (list, tuple)) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            raise UsageProblem(f"entry {head!r} of {store.child(name)} has no {sub!r}")
    return key, value


def _write(out_path: str, fmt: str, value: Any, tensors: dict[str, Any], about: dict[str, str]) -> None:
    """``value`` (torch.save) or ``tensors`` (safetensors) to ``out_path``, whole or not at all."""
    import torch

    directory = os.path.dirname(os.path.abspath(out_path))
    tmp = os.path.join(directory, f".{os.path.basename(out_path)}.tmp.{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp, metadata=about)
        else:
            torch.save(value, tmp)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
