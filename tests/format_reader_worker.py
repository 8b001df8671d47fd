"""Snapshots written by STOCK torchsnapshot for tests/test_format_reader.py.

Never imports tnt_snapshot_plugin while taking (the plugin patches torchsnapshot process-wide):
the snapshot on disk is exactly what torchsnapshot alone writes.

``python format_reader_worker.py dense SNAPDIR EXPECTED``: one process, every dense entry kind;
torch.save's the values it took to EXPECTED.

``python format_reader_worker.py sharded SNAPDIR OUTDIR RANK WORLD RENDEZVOUS``: one rank of a
2-rank gloo group; takes a ShardedTensor, DTensors (sharded and replicated) and replicated and
per-rank tensors, then reads them back with the plugin's reader under another sharding and
writes what it saw to OUTDIR/rank{RANK}.json.
"""

from __future__ import annotations

import collections
import datetime
import os
import sys

import numpy as np
import torch


def dense_state() -> dict:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "f32": r(3, 5),
        "f64": r(4, dtype=torch.float64),
        "f16": r(6, dtype=torch.float16),
        "bf16": r(8, dtype=torch.bfloat16),  # stock torchsnapshot mis-writes odd lengths
        "i64": torch.arange(5),
        "i32": torch.arange(6, dtype=torch.int32),
        "i16": torch.arange(-3, 4, dtype=torch.int16),
        "i8": torch.arange(-4, 5, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "empty1": torch.empty(0),
        "empty3": torch.empty(3, 0, 2, dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "noncontig": r(4, 6).t(),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "c128": torch.randn(2, 2, generator=g, dtype=torch.complex128),
        "q8": torch.quantize_per_tensor(r(4), 0.1, 3, torch.qint8),
        "qch": torch.quantize_per_channel(r(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8),
        "big": r(16384),  # 64 KiB: its own file (the slab threshold is 16 KiB), not chunked
        "chunked": r(40000),  # 160,000 bytes: three 64 KiB chunks
        "chunked2d": r(300, 257, dtype=torch.bfloat16),
        "nested": {
            "list": [r(2), 3, "x", [1.5, -0.0]],
            "od": collections.OrderedDict([(3, r(2)), ("a/b%c", 7)]),
            "int_keys": {1: "one", -2: b"\x00\xff", "7": 7.0},
            "empty_list": [],
            "empty_dict": {},
        },
        "tuple": (1, r(2)),
        "np": np.arange(4.0),
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5),
        "tuple_keys": {(1, 2): 3},
        "prims": [7, "s", True, False, b"bytes", 1.25, float("inf"), None, -(2**70)],
    }


def take_dense(snapdir: str, expected: str) -> None:
    os.environ["TORCHSNAPSHOT_MAX_CHUNK_SIZE_BYTES_OVERRIDE"] = str(64 * 1024)
    os.environ["TORCHSNAPSHOT_SLAB_SIZE_THRESHOLD_BYTES_OVERRIDE"] = str(16 * 1024)
    import torchsnapshot

    model = dense_state()
    other = {"t": torch.arange(3.0)}
    torchsnapshot.Snapshot.take(
        snapdir,
        {"model": torchsnapshot.StateDict(model), "other/key%": torchsnapshot.StateDict(other)},
        replicated=["other%2Fkey%25/**"],
    )
    assert "tnt_snapshot_plugin" not in sys.modules
    torch.save({"model": model, "other/key%": other}, expected)


ROWS, COLS = 10, 6


def globals_() -> dict[str, torch.Tensor]:
    return {
        "st": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
        "dt": torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) * 3,
        "drep": torch.arange(ROWS * COLS, dtype=torch.int64).reshape(ROWS, COLS) - 7,
        "rep": torch.arange(5.0),
    }


def take_sharded(snapdir: str, rank: int) -> None:
    import torch.distributed as dist
    import torchsnapshot
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = globals_()
    st = sharded_tensor.empty(ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"]), ROWS, COLS)
    for shard in st.local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        shard.tensor.copy_(full["st"][r0:r0 + nr, c0:c0 + nc])
    mesh = init_device_mesh("cpu", (2,))
    state = {
        "st": st,
        "dt": distribute_tensor(full["dt"], mesh, [Shard(0)]),
        "drep": distribute_tensor(full["drep"], mesh, [Replicate()]),
        "rep": full["rep"],
        "mine": torch.full((3,), float(rank)),
        "step": 11,
    }
    torchsnapshot.Snapshot.take(snapdir, {"model": torchsnapshot.StateDict(state)}, replicated=["model/rep", "model/step"])
    assert "tnt_snapshot_plugin" not in sys.modules
    dist.barrier()


def read_resharded(snapdir: str, rank: int, record: dict) -> None:
    """Read what take_sharded wrote under other shardings: a ShardedTensor of three 2-d boxes
    (two on rank 1), a DTensor sharded on the other dim, the replicated DTensor sharded."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tnt_snapshot_plugin.format.torchsnapshot.reader import parse_metadata, rank_view, read_state_dict

    full = globals_()
    spec = EnumerableShardingSpec([
        ShardMetadata([0, 0], [4, COLS], "rank:0/cpu"),
        ShardMetadata([4, 0], [6, 3], "rank:1/cpu"),
        ShardMetadata([4, 3], [6, 3], "rank:1/cpu"),
    ])
    st = sharded_tensor.empty(spec, ROWS, COLS)
    for shard in st.local_shards():
        shard.tensor.fill_(-1)
    mesh = init_device_mesh("cpu", (2,))
    target = {
        "st": st,
        "dt": distribute_tensor(torch.zeros(ROWS, COLS, dtype=torch.float64), mesh, [Shard(1)]),
        "drep": distribute_tensor(torch.zeros(ROWS, COLS, dtype=torch.int64), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros(5), mesh, [Shard(0)]),  # saved whole, read sharded
        "mine": torch.zeros(3),
        "step": 0,
    }
    with open(os.path.join(snapdir, ".snapshot_metadata"), "rb") as f:
        meta = parse_metadata(f.read(), snapdir)
    calls: list[int] = []

    def read_into(reads: list, done=None) -> None:
        calls.append(len(reads))
        for rel, offset, view in reads:
            fd = os.open(os.path.join(snapdir, rel), os.O_RDONLY)
            try:
                assert os.preadv(fd, [view], offset) == view.nbytes
            finally:
                os.close(fd)

    out = read_state_dict(rank_view(meta, rank), "model", target, read_into)
    record["calls"] = calls
    record["same_objects"] = all(out[k] is target[k] for k in ("st", "dt", "drep", "rep", "mine"))
    boxes = []
    for shard in out["st"].local_shards():
        (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        boxes.append(torch.equal(shard.tensor, full["st"][r0:r0 + nr, c0:c0 + nc]))
    record["st_boxes"] = boxes
    record["dt"] = torch.equal(out["dt"].full_tensor(), full["dt"])
    record["dt_local_cols"] = list(out["dt"].to_local().shape)
    record["drep"] = torch.equal(out["drep"].full_tensor(), full["drep"])
    record["rep"] = torch.equal(out["rep"].full_tensor(), full["rep"])
    record["mine"] = out["mine"].tolist()
    record["step"] = out["step"]


def sharded(snapdir: str, out: str, rank: int, world: int, rendezvous: str) -> None:
    from gloo_worker import run_rank

    def body(record: dict) -> None:
        take_sharded(snapdir, rank)
        read_resharded(snapdir, rank, record)

    run_rank(rank, world, rendezvous, os.path.join(out, f"rank{rank}.json"), body)


if __name__ == "__main__":
    if sys.argv[1] == "dense":
        take_dense(sys.argv[2], sys.argv[3])
    else:
        sharded(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
