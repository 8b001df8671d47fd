"""Restores snapshots with stock torchsnapshot only, for tests/test_format_writer.py.

It never imports tnt_snapshot_plugin (checked on exit), so what it reads proves that stock
torchsnapshot understands what the plugin's writer wrote. Two modes:

* ``python tests/stock_reader.py single OUT SNAPSHOT...``: one process; every key of every
  SNAPSHOT is restored twice, into an empty ``StateDict`` (the saved values as torchsnapshot
  rebuilds them) and into zero-filled tensors of the same dtype and shape (torchsnapshot's
  in-place path; only this one for a snapshot holding quantized tensors); both results are
  ``torch.save``d to OUT.
* ``python tests/stock_reader.py dist SNAPSHOT OUTDIR RANK WORLD RENDEZVOUS``: one rank of a gloo
  group; restores :func:`dist_state` targets (zeros, DTensors and ShardedTensors included) and
  compares them bitwise with :func:`dist_state`'s values, writing ``OUTDIR/stock{RANK}.json``.

:func:`dist_state` is also what tests/format_writer_worker.py saves.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote

import torch
import torchsnapshot
from gloo_worker import run_rank
from torchsnapshot.io_preparers.tensor import TensorBufferConsumer

#: The logical paths the 2-rank test saves as replicated (every rank holds the same value).
REPLICATED = ("model/w", "model/big", "model/step", "model/robj", "shard/plain_rep")


def dist_state(rank: int, fill: bool) -> dict[str, dict[str, Any]]:
    """What each rank of the 2-rank test saves (``fill``) or restores into (zeros)."""
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: F401

    def value(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if fill else torch.zeros_like(tensor)

    mesh = init_device_mesh("cpu", (2,))
    mesh_1x2 = init_device_mesh("cpu", (1, 2))  # Shard over a 1-rank mesh dim: 2-rank replica groups
    spec = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])

    def sharded(full: torch.Tensor) -> Any:
        st = sharded_empty(spec, *full.shape, dtype=full.dtype)
        for shard in st.local_shards():
            start, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            shard.tensor.copy_(value(full)[start : start + size])
        return st

    model = {
        "w": value(torch.arange(6.0).reshape(2, 3)),
        "big": value(torch.arange(300, dtype=torch.float64)),
        "b": value(torch.full((3,), 1.0 + rank)),
        "odd": value(torch.arange(3, dtype=torch.bfloat16) + rank),
        "step": 7 if fill else 0,
        "name": f"rank{rank}" if fill else "",
        "obj": ("x", rank) if fill else None,
        "robj": ("shared", 1) if fill else None,
    }
    shard = {
        "dt": distribute_tensor(value(torch.arange(10.0)), mesh, [Shard(0)]),
        "dt_one": distribute_tensor(value(torch.tensor([42.0])), mesh, [Shard(0)]),  # rank 1: empty
        "dt_more": distribute_tensor(value(torch.arange(4.0) * 3), mesh, [Shard(0)]),  # the mesh of "dt" again
        "dt_part": distribute_tensor(value(torch.arange(6.0).reshape(2, 3)), mesh_1x2, [Shard(0), Replicate()]),
        "st": sharded(torch.arange(5.0)),
        "st_one": sharded(torch.tensor([5.0])),
        "plain_rep": value(torch.ones(2, 2)),
    }
    return {"model": model, "shard": shard}


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of saved and restored values (DTensor/ShardedTensor: the local part)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor):
        return isinstance(b, DTensor) and a.placements == b.placements and same(a.to_local(), b.to_local())
    if isinstance(a, ShardedTensor):
        mine, theirs = a.local_shards(), b.local_shards()
        return len(mine) == len(theirs) and all(
            x.metadata == y.metadata and same(x.tensor, y.tensor) for x, y in zip(mine, theirs, strict=True)
        )
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_quantized:
            return torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
        return torch.equal(a, b)
    return type(a) is type(b) and a == b


def single(out: str, paths: list[str]) -> None:
    results: dict[str, dict[str, Any]] = {"plain": {}, "inplace": {}}
    for path in paths:
        snapshot = torchsnapshot.Snapshot(path)
        keys = [unquote(p[2:]) for p in snapshot.metadata.manifest if p.count("/") == 1]
        tensors = [e for e in snapshot.metadata.manifest.values() if e.type == "Tensor"]
        if any(_is_quantized(e) for e in tensors):
            # torchsnapshot reads every entry of the snapshot for each key, and rebuilds a
            # quantized tensor only into a quantized target: in-place restore only
            inplace = {key: torchsnapshot.StateDict(_targets(snapshot, key)) for key in keys}
        else:
            plain = {key: torchsnapshot.StateDict() for key in keys}
            snapshot.restore(plain)
            results["plain"].update((k, dict(v)) for k, v in plain.items())
            inplace = {key: torchsnapshot.StateDict(_zeros(plain[key].data)) for key in keys}
        snapshot.restore(inplace)
        results["inplace"].update((k, dict(v)) for k, v in inplace.items())
    torch.save(results, out)


def _targets(snapshot: Any, key: str) -> dict[str, torch.Tensor]:
    """Zero tensors for the tensors saved directly under ``key``, from the manifest."""
    prefix = "0/" + key.replace("%", "%25").replace("/", "%2F") + "/"
    return {
        unquote(p[len(prefix) :]): _zeros_for(snapshot.path, e)
        for p, e in snapshot.metadata.manifest.items()
        if p.startswith(prefix) and e.type == "Tensor"
    }


def _is_quantized(entry: Any) -> bool:
    return entry.dtype in ("torch.qint8", "torch.quint8", "torch.qint32")


def _zeros_for(path: str, entry: Any) -> torch.Tensor:
    """A zero tensor of the entry's dtype and shape. A quantized one gets the saved scale and
    zero point (torchsnapshot requantizes into the target's otherwise), read with torchsnapshot's
    own deserializer."""
    dtype = getattr(torch, entry.dtype.removeprefix("torch."))
    if not _is_quantized(entry):
        return torch.zeros(entry.shape, dtype=dtype)
    with open(os.path.join(path, entry.location), "rb") as f:
        data = f.read()
    if entry.byte_range is not None:
        data = data[entry.byte_range[0] : entry.byte_range[1]]
    saved = TensorBufferConsumer.deserialize_tensor(data, entry)
    return torch.quantize_per_tensor(torch.zeros(entry.shape), saved.q_scale(), saved.q_zero_point(), dtype)


def _zeros(value: Any) -> Any:
    """``value`` with every tensor replaced by zeros of its dtype and shape: torchsnapshot's
    in-place path reads into them."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _zeros(v)) for k, v in value.items())
    if type(value) is list:
        return [_zeros(v) for v in value]
    return value


def distributed(path: str, outdir: str, rank: int, world: int, rendezvous: str) -> None:
    def body(record: dict[str, Any]) -> None:
        targets = dist_state(rank, fill=False)
        app_state = {key: torchsnapshot.StateDict(values) for key, values in targets.items()}
        torchsnapshot.Snapshot(path).restore(app_state)
        expected = dist_state(rank, fill=True)
        record["compared"] = [f"{k}/{n}" for k in expected for n in expected[k]]
        record["mismatches"] = [
            f"{key}/{name}: {app_state[key][name]!r} != {value!r}"
            for key, values in expected.items()
            for name, value in values.items()
            if not same(value, app_state[key][name])
        ]
        _never_imported_the_plugin()

    run_rank(rank, world, rendezvous, os.path.join(outdir, f"stock{rank}.json"), body, timeout_s=60)


def _never_imported_the_plugin() -> None:
    if "tnt_snapshot_plugin" in sys.modules:
        sys.exit("stock_reader imported tnt_snapshot_plugin: the check would prove nothing")


def main() -> None:
    mode, path = sys.argv[1:3]
    if mode == "single":
        single(path, sys.argv[3:])
        _never_imported_the_plugin()
    else:
        outdir, rank, world, rendezvous = sys.argv[3:7]
        distributed(path, outdir, int(rank), int(world), rendezvous)  # exits


if __name__ == "__main__":
    main()
