"""A snapshot's model weights out of it, for ``tnt-snapshot export`` and ``tnt-snapshot convert
--to torch|safetensors``: which entry (:func:`weights`), and the files written, each whole or not
at all: a ``torch.save`` file (:func:`write_torch`), one safetensors file
(:func:`write_safetensors`), or Hugging Face's layout of them (:func:`write_safetensors_dir`:
``model.safetensors``, or above a size shards ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json``).

Every file is written to a temporary name beside its final one, flushed to disk, then renamed
over it; a failure removes what was written (click.ClickException, exit status 1).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

import click

from tnt_snapshot_plugin.cli.app import UsageProblem
from tnt_snapshot_plugin.cli.entries import Snapshot, tensor_keys, tensor_leaves, weight_keys
from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.stores import fileio

#: The single file and the index of Hugging Face's safetensors layout.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: The shards' names, as Hugging Face names them (1-based, five digits).
SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
#: Hugging Face's default largest shard (``max_shard_size="5GB"``).
DEFAULT_MAX_SHARD = "5GB"

_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes of a size as Hugging Face writes one: ``5GB`` (powers of 1000), ``500MiB`` (of 1024),
    or a number of bytes. ValueError for anything else, or a size below one byte."""
    body = text.strip().upper().replace(" ", "")
    unit = next((u for u in sorted(_UNITS, key=len, reverse=True) if body.endswith(u)), "")
    number = body[: len(body) - len(unit)] if unit else body
    try:
        value = float(number) * _UNITS[unit or "B"]
    except ValueError:
        raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, 1000000)") from None
    if not value >= 1 or value == float("inf"):
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return int(value)


@dataclass
class Weights:
    """What is written of a snapshot: ``key`` (an entry, or a path below one), its ``value``, its
    ``tensors`` by dotted name, and the paths of its other values."""

    key: str
    value: Any
    tensors: dict[str, Any]
    others: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def require_safetensors(flag: str) -> None:
    """ConfigError naming ``flag`` where safetensors is not installed."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise ConfigError(f"{flag} needs safetensors: pip install 'tnt-snapshot-plugin[cli]'") from None


def weights(snap: Snapshot, key: Optional[str], *, tensors_only: bool, command: str, instead: str) -> Weights:
    """The weights of ``snap`` under ``key`` (default: the one entry holding only tensors); an
    entry holding no tensor is refused, and, with ``tensors_only`` (safetensors), one holding
    other values too (``command``: the command, and ``instead``: the option that writes
    torch.save, both named in the refusals)."""
    import torch

    store, name = snap.store, snap.name
    key, value = _entry_value(snap, key)
    if isinstance(value, torch.Tensor):
        value = {key.rstrip("/").rpartition("/")[2]: value}
    clashes: list[str] = []
    tensors, others = tensor_leaves(value, clashes=clashes)
    if not tensors:
        holding = tensor_keys(snap)
        raise UsageProblem(
            f"entry {key!r} of {store.child(name)} holds no tensors ({len(others)} other values); {command} "
            f"writes tensors: choose a --key that holds them ({', '.join(holding) or 'none in this snapshot'})"
        )
    if tensors_only and others:
        raise UsageProblem(
            f"cannot {command} {key!r} as safetensors: {others[0] or 'the entry'} is not a tensor (safetensors "
            f"holds tensors only, and {key!r} holds {len(others)} other values); write it with {instead}, "
            f"or choose a --key holding only tensors ({', '.join(weight_keys(snap)) or 'none in this snapshot'})"
        )
    if tensors_only and clashes:
        raise UsageProblem(
            f"cannot {command} {key!r} as safetensors: two of its tensors' keys join to the name "
            f"{clashes[0]!r}, and a file of tensors by name would keep only one; write it with "
            f"{instead}, or rename one of the keys"
        )
    return Weights(key, value, tensors, others)


def _entry_value(snap: Snapshot, key: Optional[str]) -> tuple[str, Any]:
    """(the key written, its value): ``key`` (a top-level entry, or a path below one), or the one
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


def _temporary(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp.{os.getpid()}")


def _failures() -> tuple[type[BaseException], ...]:
    """What a failed write raises: torch.save a RuntimeError, safetensors its SafetensorError."""
    failures: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    try:
        from safetensors import SafetensorError

        failures += (SafetensorError,)
    except ImportError:
        pass
    return failures


def _durable(tmp: str, path: str) -> None:
    """``tmp`` flushed to disk and renamed to ``path``."""
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _write_file(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then ``tmp`` made durable as ``path``; nothing left on failure."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _temporary(path)
    try:
        write(tmp)
        _durable(tmp, path)
    except _failures() as exc:
        raise click.ClickException(f"could not write {path} ({exc}); nothing was written") from exc
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fileio.fsync_dir(directory)


class _File(io.RawIOBase):
    """A file ``torch.save`` writes to that keeps the error of a failed write: torch itself
    reports only that the position is not where it expected (a full disk, say)."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.pos = 0
        self.error: Optional[OSError] = None

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.write(self.fd, view[done:])
        except OSError as exc:
            self.error = self.error or exc
            raise
        finally:
            self.pos += done
        return done


def write_torch(path: str, value: Any) -> None:
    """``value`` as a ``torch.save`` file at ``path``, whole or not at all."""
    import torch

    def write(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        file = _File(fd)
        try:
            torch.save(value, file)  # type: ignore[arg-type]  # a file torch.save writes to
        except RuntimeError:
            if file.error is not None:
                raise file.error from None  # what failed, not where torch found itself
            raise
        finally:
            os.close(fd)

    _write_file(path, write)


def _safetensors_metadata(about: dict[str, str]) -> dict[str, str]:
    return {"format": "pt", **about}  # "format": what Hugging Face's loaders look for


def _save_safetensors(tmp: str, tensors: dict[str, Any], about: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, tmp, metadata=_safetensors_metadata(about))


def write_safetensors(path: str, tensors: dict[str, Any], about: dict[str, str]) -> None:
    """``tensors`` as one safetensors file at ``path`` (``about``: its metadata), whole or not at all."""
    _write_file(path, lambda tmp: _save_safetensors(tmp, tensors, about))


def shards(tensors: dict[str, Any], max_bytes: int) -> list[list[str]]:
    """The tensors' names grouped into files of at most ``max_bytes`` each, in order, as Hugging
    Face splits a state dict (a tensor larger than that gets a file of its own)."""
    groups: list[list[str]] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if not groups or (groups[-1] and size + nbytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_safetensors_dir(
    path: str, tensors: dict[str, Any], about: dict[str, str], max_bytes: int,
    advance: Optional[Callable[[int], None]] = None,
) -> list[str]:
    """``tensors`` in Hugging Face's layout in the new folder ``path``: ``model.safetensors``, or
    shards of at most ``max_bytes`` and their index (``weight_map``, ``metadata.total_size``).
    Written in a temporary folder beside it, each file durable, then renamed into place: a
    failure leaves nothing. The files written, in order; ``advance(nbytes)`` after each."""
    groups = shards(tensors, max_bytes)
    staging = _temporary(path)
    names = [SAFETENSORS_FILE] if len(groups) == 1 else [
        SHARD_NAME.format(index=i + 1, count=len(groups)) for i in range(len(groups))
    ]
    try:
        os.mkdir(staging)
        for file, group in zip(names, groups, strict=True):
            part = {name: tensors[name] for name in group}
            target = os.path.join(staging, file)
            _save_safetensors(target + ".tmp", part, about)
            _durable(target + ".tmp", target)
            if advance is not None:
                advance(sum(t.numel() * t.element_size() for t in part.values()))
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                "weight_map": {name: file for file, group in zip(names, groups, strict=True) for name in sorted(group)},
            }
            target = os.path.join(staging, SAFETENSORS_INDEX)
            with open(target + ".tmp", "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            _durable(target + ".tmp", target)
            names.append(SAFETENSORS_INDEX)
        fileio.fsync_dir(staging)
        os.rename(staging, path)
    except _failures() as exc:
        raise click.ClickException(f"could not write {path} ({exc}); nothing was written") from exc
    finally:
        if os.path.exists(staging):
            shutil.rmtree(staging, ignore_errors=True)
    fileio.fsync_dir(os.path.dirname(os.path.abspath(path)))
    return names


__all__ = [
    "DEFAULT_MAX_SHARD", "SAFETENSORS_FILE", "SAFETENSORS_INDEX", "SHARD_NAME", "Weights",
    "parse_size", "require_safetensors", "shards", "weights", "write_safetensors", "write_safetensors_dir",
    "write_torch",
]
