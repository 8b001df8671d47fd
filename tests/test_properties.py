"""Property-based tests of the one reader (hypothesis): real snapshots, their metadata and index
damaged in the ways a hostile review found, then sealed again, so that only the structure checks
can tell (format/structure.py, format/manifest.py, index.py).

Three runs of two snapshots each (epoch_0_step_1, epoch_0_step_2, different values) are written
once per module by real writers: the plugin's ``Snapshotter`` on one process (tensors of many
dtypes and shapes, packed and in files of their own, torch.save'd ones, an object, numbers);
the plugin on two gloo processes (DTensors sharded along each dimension, evenly and not, and a
ShardedTensor: an index in parts, each rank's records located in the metadata); and stock
torchsnapshot on the same two processes (ChunkedTensors, 64-byte chunks). Each example copies a
run, damages the newest snapshot with one mutation of one family, seals it again as the writer
would (the metadata's checksum, each rank's group of records and its digest, the index's parts
and seal), and asserts the invariant:

* ``verify.check`` (the one verdict) and a restore by path agree: the restore returns exactly the
  saved values, or refuses with SnapshotCorruptError where the verdict finds damage; restore_from_
  latest restores the snapshot or falls back to the older one with a warning naming it;
* every ``tnt-snapshot`` command (ls, verify, inspect, diff, export) ends with a documented exit
  status and no traceback: a damaged snapshot is one line and exit status 2, or a verdict that
  names it; anything else is the answer the intact snapshot gives;
* each check stays within a bound of memory (tracemalloc) and time (an alarm, far above need).

The families: pieces that do not tile their tensor (a gap, an overlap, a piece outside it), counts
without a bound or that contradict each other, file names in the index that leave the snapshot or
another rank's, tensors torch would reject (a shape whose elements overflow int64, a meta-device
tensor in a payload), and byte ranges overlapping in one file. The payload family is the one
the cheap check restore_from_latest makes cannot see without unpickling: there the restore
refuses and falls back, ``tnt-snapshot verify`` (which reads and unpickles every payload) calls
the snapshot damaged, and the commands that read values refuse with one line.

The default run takes a few hundred examples in all; ``HYPOTHESIS_PROFILE=long`` takes many more.
This file is also the two-process writer of the module's runs (``python test_properties.py ...``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import tracemalloc
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch

WORLD = 2
OLD, NEW = "epoch_0_step_1", "epoch_0_step_2"
METADATA, INDEX, PARTS = ".snapshot_metadata", ".tnt_snapshot_index.json", ".tnt_snapshot_index"

#: what restore may read into per snapshot file kind: these are copied; payloads are linked
CONTROL = (METADATA, INDEX, ".tnt_writer.json")


# ---------------------------------------------------------------------------------------------
# The states saved (both writers' processes build them alike)


def single_state(step: int) -> dict[str, Any]:
    """The one-process run's state at ``step``: tensors of varied dtypes and shapes (drawn from a
    fixed seed), packed and in a file of their own, torch.save'd ones, an object, numbers."""
    rng = random.Random(7)
    g = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {}
    for i in range(8):
        dtype = rng.choice([torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool, torch.uint8])
        shape = [rng.randint(1, 5) for _ in range(rng.randint(0, 3))]
        value = torch.randn(shape, generator=g) * 50
        state[f"t{i}"] = value > 0 if dtype is torch.bool else value.to(dtype)
    state["c64"] = torch.randn(3, generator=g, dtype=torch.complex64)  # torch.save'd, packed
    state["empty"] = torch.zeros(0, 3)  # torch.save'd
    state["big"] = torch.randn(1_100_000, generator=g)  # over 4 MiB: a file of its own
    state["obj"] = (step, "two")  # an object: torch.save'd to its own file
    state["n"], state["name"] = step, f"s{step}"
    return state


def sharded_full(step: int) -> dict[str, torch.Tensor]:
    """The whole tensors the two-process runs save sharded (and chunked) at ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return {
        "rows": torch.randn(6, 3, generator=g),  # Shard(0), even
        "cols": torch.randn(2, 5, generator=g),  # Shard(1), uneven
        "odd": torch.randn(3, generator=g),  # Shard(0) of 3 over 2: 2 and 1
        "tiny": torch.randn(1, 2, generator=g),  # Shard(0) of 1 over 2: one rank holds nothing
        "st": torch.randn(4, 2, generator=g),  # a ShardedTensor, rows 2 and 2
    }


def stock_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(200 + step)
    return {"chunked": torch.randn(50, generator=g), "chunked2d": torch.randn(9, 7, generator=g), "small": torch.arange(4.0) + step,
            "obj": {"step": step}}


# ---------------------------------------------------------------------------------------------
# The two-process writer (run by the module fixture)


def _write_two_ranks(rank: int, world: int, rendezvous: str, out: str) -> None:
    import gloo_worker

    def body(record: dict[str, Any]) -> None:
        import numpy as np
        import torch.distributed as dist
        import torchsnapshot
        from torch.distributed._shard import sharded_tensor
        from torch.distributed._shard.sharding_spec import ChunkShardingSpec
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torchsnapshot.knobs import override_max_chunk_size_bytes

        from tnt_snapshot_plugin import SnapshotConfig, Snapshotter
        from toy import Holder

        mesh = init_device_mesh("cpu", (world,))
        spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
        saver = Snapshotter(os.path.join(out, "sharded"), SnapshotConfig.build(async_snapshot=False, replicated=["plain/**"]))
        saver.train_start(["model", "plain"], 0, 0)
        for step in (1, 2):
            full = sharded_full(step)
            st = sharded_tensor.empty(spec, *full["st"].shape)
            for shard in st.local_shards():
                rows = shard.metadata.shard_offsets[0]
                shard.tensor.copy_(full["st"][rows:rows + shard.tensor.shape[0]])
            model = {
                "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                "odd": distribute_tensor(full["odd"], mesh, [Shard(0)]),
                "tiny": distribute_tensor(full["tiny"], mesh, [Shard(0)]),
                "st": st,
            }
            torch.manual_seed(step)  # the same RNG state on every rank: restorable on one
            random.seed(step)
            np.random.seed(step)
            saver.save(0, step, {"model": Holder(model), "plain": Holder({"w": full["rows"] * 2, "k": step})})
        saver.train_end(0, 2, lambda intra_epoch: {})
        for step in (1, 2):  # stock torchsnapshot: ChunkedTensors of 64-byte chunks
            with override_max_chunk_size_bytes(64):
                path = os.path.join(out, "stock", f"epoch_0_step_{step}")
                torchsnapshot.Snapshot.take(path, {"model": torchsnapshot.StateDict(**stock_state(step))}, replicated=["**"])
        dist.barrier()

    gloo_worker.run_rank(rank, world, rendezvous, os.path.join(out, f"writer{rank}.json"), body)


# ---------------------------------------------------------------------------------------------
# The runs


@dataclass
class Run:
    """Two snapshots written by a real writer: ``expected[name]`` holds each one's state by
    key; ``targets()`` a state of zeros to restore into; ``export_key`` what export writes."""

    kind: str
    path: Path
    expected: dict[str, dict[str, Any]]
    targets: Callable[[], dict[str, Any]]
    export_key: str
    pristine_diff: Any = None


def _zeros(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    import launching

    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter
    from toy import Holder

    root = tmp_path_factory.mktemp("properties")
    saver = Snapshotter(str(root / "single"), SnapshotConfig.build(async_snapshot=False))
    saver.train_start(["m"], 0, 0)
    for step in (1, 2):
        saver.save(0, step, {"m": Holder(single_state(step))})
    saver.train_end(0, 2, lambda intra_epoch: {})
    launching.run_ranks(
        lambda rank: [__file__, "write", str(rank), str(WORLD), str(root / "rendezvous"), str(root)],
        WORLD,
        lambda rank: root / f"writer{rank}.log",
        lambda rank: root / f"writer{rank}.json",
        "two-rank writer",
    )
    found = {
        "single": Run(
            "single", root / "single",
            {f"epoch_0_step_{s}": {"m": single_state(s)} for s in (1, 2)},
            lambda: {"m": Holder(_zeros(single_state(0)))}, "m",
        ),
        "sharded": Run(
            "sharded", root / "sharded",
            {f"epoch_0_step_{s}": {"model": sharded_full(s), "plain": {"w": sharded_full(s)["rows"] * 2, "k": s}} for s in (1, 2)},
            lambda: {"model": Holder(_zeros(sharded_full(0))), "plain": Holder({"w": torch.zeros(6, 3), "k": None})}, "plain",
        ),
        "stock": Run(
            "stock", root / "stock",
            {f"epoch_0_step_{s}": {"model": stock_state(s)} for s in (1, 2)},
            lambda: {"model": Holder(_zeros(stock_state(0)))}, "model",
        ),
    }
    for run in found.values():
        code, out, _ = cli("diff", str(run.path / OLD), str(run.path / NEW), "--json")
        assert code == 1, out
        run.pristine_diff = json.loads(out)
    return found


# ---------------------------------------------------------------------------------------------
# A copy of a run, edited and sealed again


class Copy:
    """A copy of a run (payloads hard-linked, never written through) whose newest snapshot's
    metadata (``doc``), index (``index``) and parts (``parts``) a mutation edits; :meth:`seal`
    writes them back as the writer would."""

    def __init__(self, run: Run, dst: Path) -> None:
        from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases

        self.run, self.path = run, dst
        for src in run.path.rglob("*"):
            target = dst / src.relative_to(run.path)
            if src.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif src.name in CONTROL or PARTS in src.parts:
                shutil.copyfile(src, target)
            else:
                os.link(src, target)
        self.snap = dst / NEW
        self.doc = mesh_aliases.loads((self.snap / METADATA).read_bytes())
        self.index = json.loads((self.snap / INDEX).read_text()) if (self.snap / INDEX).exists() else None
        self.parts: dict[int, dict[str, Any]] = {}
        for rank, _ in enumerate((self.index or {}).get("parts") or []):
            self.parts[rank] = json.loads((self.snap / PARTS / f"{rank}.json").read_bytes())
        self.payloads: dict[str, bytes] = {}  # payload files written anew (rel -> bytes)
        self.keep_regions = False  # a mutation set the index's "ranks" itself

    @property
    def manifest(self) -> dict[str, dict]:
        return self.doc["manifest"]

    def write_payload(self, rel: str, data: bytes) -> None:
        self.payloads[rel] = data

    def metadata_bytes(self) -> tuple[bytes, Optional[list[list[Any]]]]:
        from tnt_snapshot_plugin.format.torchsnapshot.groups import Group, metadata_views
        from tnt_snapshot_plugin.format.torchsnapshot.merging import metadata_bytes

        records = {path: json.dumps(entry) for path, entry in self.manifest.items()}
        world = self.doc.get("world_size")
        if self.index is None:
            return json.dumps(self.doc).encode(), None
        ranks = self.index.get("ranks")
        if not ranks:
            return bytes(metadata_bytes(records, world)), None
        groups: list[dict[str, str]] = [{} for _ in ranks["regions"]]
        for path, record in records.items():  # each rank's records in its group, as the writer groups them
            head = path.partition("/")[0]
            groups[int(head) if head.isdigit() and int(head) < len(groups) else 0][path] = record
        built = [Group(group) for group in groups]
        views, regions = metadata_views(world, [(g.data, g.digest) for g in built])
        return b"".join(bytes(v) for v in views), regions

    def seal(self) -> None:
        """Write the metadata, payloads, parts and index back, every checksum and digest made
        again as the writer makes them."""
        from tnt_snapshot_plugin.format.checksums import record_views, record_whole
        from tnt_snapshot_plugin.format.index import owner, part_bytes, part_entry, seal

        data, regions = self.metadata_bytes()
        _replace(self.snap / METADATA, data)
        for rel, payload in self.payloads.items():
            _replace(self.snap / rel, payload)
        if self.index is None:
            return
        index = {k: v for k, v in self.index.items() if k != "seal"}
        index["checksums"] = {**index.get("checksums", {}), METADATA: record_whole([data])}
        if regions is not None and not self.keep_regions:
            index["ranks"] = {**index["ranks"], "regions": regions}
        for rel, payload in self.payloads.items():
            rank = owner(rel)
            listing = self.parts[rank] if self.parts and rank in self.parts else index
            listing["files"][rel] = len(payload)
            listing["checksums"][rel] = record_views([memoryview(payload)])
        for rank, part in self.parts.items():
            text = part_bytes(part["files"], part["checksums"])
            _replace(self.snap / PARTS / f"{rank}.json", text)
            if rank < len(index.get("parts") or []):
                index["parts"][rank] = part_entry(text)
        _replace(self.snap / INDEX, seal(index))


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` as a new file (a hard-linked payload of the run stays as it is)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    path.write_bytes(data)


# ---------------------------------------------------------------------------------------------
# The mutations: each edits a Copy and returns what it did, or None where it does not apply


def _pieces(c: Copy) -> list[tuple[str, str]]:
    return [
        (path, "chunks" if e["type"] == "ChunkedTensor" else "shards")
        for path, e in c.manifest.items()
        if e.get("chunks") or e.get("shards")
    ]


def _raw_end(tensor: dict, sizes: list[int]) -> None:
    """Make a piece's tensor record hold ``sizes`` (its shape and, where it has one, its byte range)."""
    from tnt_snapshot_plugin.format.torchsnapshot.manifest import DTYPE_SIZES

    tensor["shape"] = list(sizes)
    numel = 1
    for n in sizes:
        numel *= n
    if tensor.get("byte_range") is not None and tensor.get("serializer") == "buffer_protocol":
        tensor["byte_range"] = [tensor["byte_range"][0], tensor["byte_range"][0] + numel * DTYPE_SIZES[tensor["dtype"]]]


def tiling(c: Copy, data: Any) -> Optional[str]:
    """Pieces that no longer tile their tensor: one shrunk (a gap), moved (an overlap and a gap),
    grown, pushed outside the shape, dropped, copied to another place; the declared shape (a
    ChunkedTensor's, the index's record of a sharded one) changed. Also the one edit that keeps
    the tiling: a piece recorded twice at the same place (a replica), which must restore."""
    from hypothesis import strategies as st

    candidates = _pieces(c)
    if not candidates:
        return None
    path, field = data.draw(st.sampled_from(candidates), label="entry")
    entry = c.manifest[path]
    pieces = entry[field]
    i = data.draw(st.integers(0, len(pieces) - 1), label="piece")
    piece = pieces[i]
    offsets, sizes = piece["offsets"], piece["sizes"]
    ndim = len(sizes)
    how = data.draw(st.sampled_from(["shrink", "move", "grow", "outside", "drop", "copy", "replica", "shape"]), label="how")
    if ndim == 0 or not all(sizes):
        how = "shape" if how not in ("drop", "replica") else how
    if how == "replica":
        pieces.append(copy.deepcopy(piece))
        return f"{path}: piece {i} recorded twice"
    if how == "drop":
        if not all(sizes):
            return None
        del pieces[i]
        return f"{path}: piece {i} dropped"
    if how == "shape":
        if field == "chunks":
            d = data.draw(st.integers(0, max(0, len(entry["shape"]) - 1)))
            if not entry["shape"]:
                return None
            delta = data.draw(st.sampled_from([-1, 1, 3]))
            if entry["shape"][d] + delta < 0:
                return None
            entry["shape"][d] += delta
            return f"{path}: shape dim {d} {delta:+d}"
        shapes = (c.index or {}).get("ranks", {}).get("shapes") if c.index else None
        logical = path.partition("/")[2]
        if not shapes or logical not in shapes or not shapes[logical]:
            return None
        d = data.draw(st.integers(0, len(shapes[logical]) - 1))
        delta = data.draw(st.sampled_from([-1, 1, 2]))
        if shapes[logical][d] + delta < 0:
            return None
        shapes[logical][d] += delta
        return f"index shape of {logical} dim {d} {delta:+d}"
    d = data.draw(st.integers(0, ndim - 1), label="dim")
    if how == "shrink":
        if sizes[d] < 2:
            return None
        sizes[d] = data.draw(st.integers(1, sizes[d] - 1))
        _raw_end(piece["tensor"], sizes)
        return f"{path}: piece {i} shrunk along {d}"
    if how == "grow":
        sizes[d] += data.draw(st.integers(1, 3))
        _raw_end(piece["tensor"], sizes)
        return f"{path}: piece {i} grown along {d}"
    if how == "move":
        step = data.draw(st.sampled_from([-2, -1, 1, 2]))
        if offsets[d] + step < 0:
            return None
        offsets[d] += step
        return f"{path}: piece {i} moved {step:+d} along {d}"
    if how == "outside":
        offsets[d] += data.draw(st.integers(1, 1 << 20))
        return f"{path}: piece {i} pushed outside along {d}"
    # copy: the piece once more, somewhere else
    extra = copy.deepcopy(piece)
    extra["offsets"][d] += data.draw(st.sampled_from([-1, 1]))
    if extra["offsets"][d] < 0:
        return None
    pieces.append(extra)
    return f"{path}: piece {i} copied to another offset"


def counts(c: Copy, data: Any) -> Optional[str]:
    """Counts without a bound, or that contradict each other: the metadata's world size, a
    tensor's dimensions, element count or byte range end past int64, a piece's offset, the
    index's world size, parts or located groups."""
    from hypothesis import strategies as st

    what = data.draw(st.sampled_from(["world_size", "ndim", "numel", "zero_dim", "range_end", "far_range", "offset",
                                      "index_world", "parts", "regions"]), label="count")
    tensors = [p for p, e in c.manifest.items() if e["type"] == "Tensor"]
    if what == "world_size":
        value = data.draw(st.sampled_from([0, -1, 1, 1 << 21, 10**12, 2**63, 2**64, "2", 1.5, None, True]))
        if value == c.doc["world_size"] and type(value) is int:
            return None
        c.doc["world_size"] = value
        return f"world_size {value!r}"
    if what == "offset":
        candidates = _pieces(c)
        if not candidates:
            return None
        path, field = data.draw(st.sampled_from(candidates))
        piece = data.draw(st.sampled_from(c.manifest[path][field]))
        if not piece["offsets"]:
            return None
        piece["offsets"][0] = data.draw(st.sampled_from([2**62, 2**63, 2**64]))
        return f"{path}: offset {piece['offsets'][0]}"
    if what in ("index_world", "parts", "regions"):
        if c.index is None:
            return None
        if what == "index_world":
            value = data.draw(st.sampled_from([0, 2, 3, 1 << 21, 10**12, "1"]))
            if value == c.index.get("world_size"):
                return None
            c.index["world_size"] = value
            return f"index world_size {value!r}"
        if what == "parts":
            if not c.index.get("parts"):
                return None
            c.index["parts"].append([3, "0" * 16])
            return "an extra part listed"
        ranks = c.index.get("ranks")
        if not ranks:
            return None
        c.keep_regions = True
        end = ranks["regions"][-1][1]
        ranks["regions"] = ranks["regions"] + [[end, end, ""]]
        return "an extra group of records located"
    if not tensors:
        return None
    path = data.draw(st.sampled_from(tensors), label="tensor")
    entry = c.manifest[path]
    if what == "ndim":
        entry["shape"] = entry["shape"] + [1] * (65 - len(entry["shape"]))
        return f"{path}: 65 dimensions"
    if what == "numel":
        entry["shape"] = data.draw(st.sampled_from([[2**40, 2**40], [2**62, 4], [2**31, 2**31, 2**31], [2**63]]))
        entry["serializer"] = data.draw(st.sampled_from(["torch_save", entry["serializer"]]))
        return f"{path}: shape {entry['shape']}"
    if what == "zero_dim":
        entry["shape"] = [0, 2**70]
        return f"{path}: shape [0, 2**70]"
    if what == "range_end":
        start = (entry.get("byte_range") or [0, 0])[0]
        entry["byte_range"] = [start, data.draw(st.sampled_from([2**63, 2**64, 2**80]))]
        return f"{path}: byte range to {entry['byte_range'][1]}"
    # a byte range inside int64 and of the right length, far past the end of its file
    start, end = entry.get("byte_range") or [0, None]
    if end is None:
        return None
    far = data.draw(st.sampled_from([1 << 40, (1 << 62) - (end - start)]))
    entry["byte_range"] = [far, far + end - start]
    return f"{path}: byte range at {far}"


BAD_NAMES = ["../x", "../../outside", "/abs/x", "0/../../x", "0//x", "./0/x", "0/./x", "9/x", "batched/9-0", "x", "3/..", "0/x\x00y"]


def names(c: Copy, data: Any) -> Optional[str]:
    """File names in the index (or a rank's part of it) that leave the snapshot or belong to
    another rank: a file renamed, or one added; in ``files`` or in ``checksums``. A real file
    of the listed size waits outside the snapshot where the name leads, so a verdict that stats
    it before refusing it would find it there."""
    from hypothesis import strategies as st

    if c.index is None:
        return None
    listings: list[tuple[str, dict[str, Any]]] = [("index", c.index)]
    listings += [(f"part {rank}", part) for rank, part in c.parts.items()]
    where, listing = data.draw(st.sampled_from(listings), label="listing")
    field = data.draw(st.sampled_from(["files", "checksums"]), label="field")
    bad = data.draw(st.sampled_from(BAD_NAMES + [f"{r}/stray" for r in range(3)]), label="name")
    files = listing.setdefault(field, {})
    rels = sorted(k for k in files if k != METADATA)
    if where.startswith("part "):
        rank = int(where.split()[1])
        if bad.startswith(f"{rank}/") and "." not in bad and "//" not in bad:
            return None  # its own rank's: a name the part may hold (a file then missing)
    elif bad in ("9/x", "batched/9-0", "x") or bad.endswith("/stray"):
        writer = bad.partition("/")[0]
        if writer.isdigit() and int(writer) < (c.index.get("world_size") or 1):
            return None  # a rank of the snapshot: only a missing file
    if rels and data.draw(st.booleans(), label="rename"):
        rel = data.draw(st.sampled_from(rels))
        files[bad] = files.pop(rel)
        size = c.index.get("files", {}).get(rel) if field == "checksums" else files[bad]
    else:
        files[bad] = 8 if field == "files" else {"algo": "xxh3_64", "value": "0" * 16}
        size = 8
    decoy = (c.snap / bad.replace("\x00", "")).resolve() if "\x00" not in bad else None
    if decoy is not None and str(decoy).startswith(str(c.path)) and not decoy.exists() and isinstance(size, int):
        decoy.parent.mkdir(parents=True, exist_ok=True)
        decoy.write_bytes(b"\x00" * size)  # what a stat of the name would find
    return f"{where} {field}: {bad!r}"


def ranges(c: Copy, data: Any) -> Optional[str]:
    """Two entries reading overlapping bytes of one file: one range moved onto another's (the
    same range, or one that crosses it), or a whole-file payload pointed at a pack."""
    from hypothesis import strategies as st

    by_file: dict[str, list[str]] = {}
    for path, entry in c.manifest.items():
        for rec_path, rec in _records(path, entry):
            if rec.get("byte_range") is not None and rec["byte_range"][1] > rec["byte_range"][0]:
                by_file.setdefault(rec["location"], []).append(rec_path)
    shared = {rel: paths for rel, paths in by_file.items() if len(paths) > 1}
    how = data.draw(st.sampled_from(["onto", "across", "whole"]), label="how")
    if how == "whole" or not shared:
        wholes = [p for p, e in c.manifest.items() if e["type"] in ("object", "Tensor") and e.get("byte_range") is None]
        if not wholes or not by_file:
            return None
        path = data.draw(st.sampled_from(wholes))
        rel = data.draw(st.sampled_from(sorted(by_file)))
        c.manifest[path]["location"] = rel
        return f"{path}: reads the whole of {rel}"
    rel = data.draw(st.sampled_from(sorted(shared)), label="file")
    a_path, b_path = data.draw(st.permutations(shared[rel]), label="pair")[:2]
    a, b = _record(c, a_path), _record(c, b_path)
    (a0, a1), (b0, b1) = a["byte_range"], b["byte_range"]
    length = b1 - b0
    if how == "onto":
        if length != a1 - a0:
            b["byte_range"] = [a0, a0 + length]  # (and not of b's size: refused for that too)
        else:
            b["byte_range"] = [a0, a1]
    else:
        start = data.draw(st.integers(max(0, a0 - length + 1), a1 - 1))
        b["byte_range"] = [start, start + length]
    if b["byte_range"] == [b0, b1]:
        return None
    return f"{b_path}: byte range {b['byte_range']} over {a_path}'s {[a0, a1]}"


def _records(path: str, entry: dict) -> Iterator[tuple[str, dict]]:
    if entry.get("type") in ("Tensor", "object"):
        yield path, entry
    for i, piece in enumerate(entry.get("chunks") or entry.get("shards") or ()):
        yield f"{path}#{i}", piece["tensor"]


def _record(c: Copy, rec_path: str) -> dict:
    path, _, i = rec_path.partition("#")
    entry = c.manifest[path]
    return entry if not i else (entry.get("chunks") or entry.get("shards"))[int(i)]["tensor"]


def payloads(c: Copy, data: Any) -> Optional[str]:
    """Tensors torch would reject, in payloads (checksummed again): a meta-device tensor inside
    an object; a torch.save'd tensor entry whose payload is a meta tensor, or a tensor of another
    shape or dtype than its entry says (moved to a file of its own)."""
    from hypothesis import strategies as st

    objects = [p for p, e in c.manifest.items() if e["type"] == "object"]
    saved = [p for p, e in c.manifest.items() if e["type"] == "Tensor" and e["serializer"] == "torch_save"]
    how = data.draw(st.sampled_from(["object", "tensor"]), label="how")
    buffer = io.BytesIO()
    if how == "object" or not saved:
        if not objects:
            return None
        path = data.draw(st.sampled_from(objects))
        torch.save((torch.empty(2, 3, device="meta"), "two"), buffer)
        c.write_payload(c.manifest[path]["location"], buffer.getvalue())
        c.manifest[path]["byte_range"] = None
        return f"{path}: a meta tensor inside the object"
    path = data.draw(st.sampled_from(saved))
    entry = c.manifest[path]
    dtype = getattr(torch, entry["dtype"][6:])
    kind = data.draw(st.sampled_from(["meta", "shape", "dtype"]))
    shape = entry["shape"]
    if kind == "meta":
        value = torch.empty(shape, dtype=dtype, device="meta")
    elif kind == "shape":
        value = torch.zeros([n + 1 for n in shape] or [2], dtype=dtype)
    else:
        value = torch.zeros(shape, dtype=torch.float64 if dtype is not torch.float64 else torch.float32)
    torch.save(value, buffer)
    rel = path.partition("/")[0] + "/moved" + path.replace("/", "_")
    c.write_payload(rel, buffer.getvalue())
    entry["location"], entry["byte_range"] = rel, None
    return f"{path}: its payload a {kind} tensor"


#: family -> (mutation, whether verify sees it without unpickling payloads)
FAMILIES: dict[str, tuple[Callable[[Copy, Any], Optional[str]], bool]] = {
    "tiling": (tiling, True),
    "counts": (counts, True),
    "names": (names, True),
    "ranges": (ranges, True),
    "payloads": (payloads, False),
}


# ---------------------------------------------------------------------------------------------
# The invariant


def cli(*args: str) -> tuple[int, str, str]:
    from click.testing import CliRunner

    from tnt_snapshot_plugin.cli import cli as app

    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    out = result.stdout + result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, out, repr(result.exception))
    assert "Traceback" not in out, (args, out)
    assert result.exit_code in (0, 1, 2), (args, result.exit_code, out)
    if result.exit_code == 2:  # bad input: one line naming what is wrong
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("tnt-snapshot: error: "), (args, out)
    return result.exit_code, result.stdout, result.stderr


@contextlib.contextmanager
def bounded(seconds: int = 120) -> Iterator[None]:
    """Fail an example that runs past ``seconds`` (far above what one takes) instead of hanging."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"an example ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


#: What one check of a small snapshot may allocate in Python objects, at most.
PEAK_BYTES = 64 << 20


def assert_identical(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape, where
        if want.is_complex():
            got, want = torch.view_as_real(got), torch.view_as_real(want)
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_identical(got[key], want[key], f"{where}/{key}")
    else:
        assert type(got) is type(want) and got == want, where


def restored(run: Run, path: Path) -> tuple[Optional[dict[str, Any]], Optional[BaseException], list[str]]:
    """(the state restored from ``path``, or the error raised; the warnings)."""
    from tnt_snapshot_plugin import restore

    state = run.targets()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            restore(str(path), state)
        except Exception as exc:
            return None, exc, [str(w.message) for w in caught]
    return {k: v.state for k, v in state.items()}, None, [str(w.message) for w in caught]


def judge(c: Copy, what: str, visible: bool) -> None:
    """The invariant on ``c``'s damaged newest snapshot (see the module docstring)."""
    from tnt_snapshot_plugin import SnapshotCorruptError, SnapshotError, restore_from_latest
    from tnt_snapshot_plugin.format import verify
    from tnt_snapshot_plugin.stores import open_store

    run = c.run
    tracemalloc.start()
    try:
        verdict = verify.check(open_store(str(c.path)), NEW)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES, (what, peak)
    damaged = not verdict.intact

    # restore by path: the saved values exactly, or a refusal; never a restore of what verify
    # calls damaged
    state, error, _ = restored(run, c.snap)
    if error is not None:
        assert isinstance(error, SnapshotError), (what, repr(error))
        assert damaged or not visible, (what, repr(error), verdict.problems)
        assert isinstance(error, SnapshotCorruptError) and "\n" not in str(error), (what, repr(error))
    else:
        assert not damaged, (what, verdict.problems)
        for key, value in run.expected[NEW].items():
            assert_identical(state[key], value, f"{what}: {key}")

    # restore_from_latest: this snapshot, or the older one with a warning naming it
    state = run.targets()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = restore_from_latest(str(c.path), state)
    assert chosen is not None, what
    picked = Path(chosen).name
    assert picked == (OLD if error is not None else NEW), (what, picked, repr(error))
    if picked == OLD:
        assert any(NEW in str(w.message) and "skipping" in str(w.message) for w in caught), (what, [str(w.message) for w in caught])
    for key, value in run.expected[picked].items():
        assert_identical(state[key].state, value, f"{what}: latest {key}")

    # every command: a documented exit status, no traceback; exit status 2 in one line
    # ls and verify read every payload (checksums) and unpickle the torch.save'd ones: they call
    # damaged what restore refuses, the payloads' damage included, and ls names the snapshot
    # restore_from_latest restores
    deep = damaged or error is not None
    code, out, _ = cli("ls", str(c.path), "--json")
    assert code == 0
    pick = json.loads(out)["restore"]
    assert pick == picked == (OLD if deep else NEW), (what, pick, picked, verdict.problems)
    code, out, _ = cli("verify", str(c.path), "--json")
    statuses = {s["name"]: s["status"] for s in json.loads(out)["snapshots"]}
    assert code == (1 if deep else 0) and statuses.get(NEW, "damaged") == ("damaged" if deep else "complete"), (what, out)
    code, out, _ = cli("verify", str(c.snap))
    assert code == (1 if deep else 0), (what, out)
    code, out, _ = cli("inspect", str(c.snap), "--json")
    assert code in (0, 2), (what, code)
    code, out, _ = cli("diff", str(c.path / OLD), str(c.snap), "--json")
    if damaged:
        assert code == 2, (what, code, out)
    elif code != 2:
        assert json.loads(out) == {**run.pristine_diff, "b": str(c.snap), "a": str(c.path / OLD)}, what
    else:
        assert not visible, what
    target = c.path / "export.pt"
    code, out, err = cli("export", str(c.snap), str(target), "--key", run.export_key, "--force")
    if damaged:
        assert code == 2, (what, code, out, err)
    elif code == 0:
        exported = torch.load(target, weights_only=False)
        want = run.expected[NEW][run.export_key]
        assert_identical({k: v for k, v in exported.items() if k in want}, want, f"{what}: export")
    else:
        assert not visible, (what, err)


def example(runs: dict[str, Run], kind: str, family: str, data: Any) -> None:
    from hypothesis import assume

    mutate, visible = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix="prop") as tmp, bounded():
        c = Copy(runs[kind], Path(tmp) / "run")
        what = mutate(c, data)
        assume(what is not None)
        c.seal()
        judge(c, f"{kind}/{family}: {what}", visible)


# ---------------------------------------------------------------------------------------------
# The tests


def _settings(default: int, long: int) -> Any:
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=long if os.environ.get("HYPOTHESIS_PROFILE") == "long" else default,
        deadline=None,  # every example writes and reads files
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        print_blob=True,
    )


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow


@_settings(default=120, long=1500)
@given(family=st.sampled_from(["counts", "names", "ranges", "payloads"]), data=st.data())
def test_a_damaged_one_process_snapshot_restores_exactly_or_is_refused_everywhere(runs, family, data):
    example(runs, "single", family, data)


@_settings(default=120, long=1500)
@given(family=st.sampled_from(["tiling", "tiling", "counts", "names", "ranges"]), data=st.data())
def test_a_damaged_sharded_snapshot_restores_exactly_or_is_refused_everywhere(runs, family, data):
    example(runs, "sharded", family, data)


@_settings(default=100, long=1000)
@given(family=st.sampled_from(["tiling", "tiling", "counts", "ranges", "payloads"]), data=st.data())
def test_a_damaged_stock_snapshot_restores_exactly_or_is_refused_everywhere(runs, family, data):
    example(runs, "stock", family, data)


def test_the_runs_restore_exactly_and_verify_intact(runs):
    """The runs as written: intact, restored exactly, and a copy sealed again unchanged is too
    (the sealing itself damages nothing)."""
    for run in runs.values():
        with tempfile.TemporaryDirectory(prefix="prop") as tmp:
            c = Copy(run, Path(tmp) / "run")
            c.seal()
            judge(c, f"{run.kind}: sealed again unchanged", True)
    with tempfile.TemporaryDirectory(prefix="prop") as tmp:
        kinds = {e["type"] for e in Copy(runs["stock"], Path(tmp) / "run").manifest.values()}
        assert "ChunkedTensor" in kinds
        kinds = {e["type"] for e in Copy(runs["sharded"], Path(tmp) / "sharded").manifest.values()}
        assert {"DTensor", "ShardedTensor"} <= kinds


if __name__ == "__main__":
    _, mode, rank, world, rendezvous, out = sys.argv
    assert mode == "write"
    _write_two_ranks(int(rank), int(world), rendezvous, out)
