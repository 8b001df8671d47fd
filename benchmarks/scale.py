"""How the coordination and metadata costs of a snapshot grow with the number of ranks.

Simulates N ranks in one process, without N processes: each rank's manifest records are built
by the writer's own code (``format.writer``: ``flatten``, ``plan`` and the ``_Builder`` that
lays out tensors, packs and files), over tensors that own no memory of their own (views of one
untouched allocation) and, for FSDP2, DTensor shards laid out as torch lays them out
(``_compute_local_shape_and_global_offset``) and recorded as ``_Builder.add_dtensor`` records
them. Then it runs the code paths whose cost grows with N:

* per save, on every rank: what the rank sends rank 0 (``coordination.RecordDeltas``: the
  first save, then a later one where only progress values and checksums changed);
* rank 0's commit: merge, ``.snapshot_metadata``, the index, written through a ``LocalStore``;
* latest selection: ``Store.listed`` and ``verify.check`` of the committed snapshot, as the CLI
  checks it (the whole metadata parsed) and as ``restore_from_latest`` checks it on rank 0 before N
  ranks restore it (``restoring_ranks=N``: the metadata's checksum streamed, not parsed);
* one rank's restore planning: parse and validate the metadata, the rank's view, and the
  shards it reads to reshard from N ranks to N, N/2 and 2N.

Layouts (shapes from the models' published configurations, Adam state):

* ``ddp-7b``: Llama-2 7B, every value replicated (saved once, the writes spread over the ranks);
* ``fsdp2-7b``, ``fsdp2-70b``: Llama-2 7B and 70B under ``fully_shard`` (``Shard(0)`` over N).

Every rank also saves its RNG state and train progress.

Whole-snapshot costs (commit, latest, restore planning) are measured up to ``--max-metadata``
bytes of metadata; beyond it they are extrapolated from the largest measured point
(proportional to the metadata's size, marked ``~``). Per-rank costs are measured at every N.

    python benchmarks/scale.py                 # N = 8, 64, 512, 1024, 4096 (a few minutes)
    python benchmarks/scale.py --quick         # N = 8, 64, ddp-7b and fsdp2-7b (seconds)
    python benchmarks/scale.py --out bench-results/scale.json --plots docs/img

Writes a markdown table to stdout (``--markdown FILE`` too), the raw numbers as JSON (``--out``)
and log-log plots (``--plots DIR``, matplotlib: ``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import xxhash

from tnt_snapshot_plugin.app_state import RNGState
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.checksums import record_whole
from tnt_snapshot_plugin.format.index import (
    INDEX_FNAME,
    PARTED_FORMAT,
    parse_part,
    part_bytes,
    part_entry,
    part_rel,
    seal,
)
from tnt_snapshot_plugin.format.index import parse as parse_index
from tnt_snapshot_plugin.format.torchsnapshot import manifest as mf
from tnt_snapshot_plugin.format.torchsnapshot import mesh_aliases, rank_regions
from tnt_snapshot_plugin.format.torchsnapshot import writer as fmt
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.format.torchsnapshot.coordination import RecordDeltas, grouped_metadata
from tnt_snapshot_plugin.stores import open_store

PACK_BYTES = 4 << 20
MiB = 1 << 20


# --- models ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decoder:
    """A Llama-style decoder's published configuration."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, as Hugging Face's LlamaForCausalLM names them."""
        h, head_dim = self.hidden, self.hidden // self.heads
        kv = self.kv_heads * head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            out += [
                (f"{p}.self_attn.q_proj.weight", (h, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, h)),
                (f"{p}.mlp.gate_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.up_proj.weight", (self.intermediate, h)),
                (f"{p}.mlp.down_proj.weight", (h, self.intermediate)),
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.post_attention_layernorm.weight", (h,)),
            ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    def numel(self) -> int:
        return sum(math.prod(shape) for _n, shape in self.parameters())


LLAMA2_7B = Decoder("llama2-7b", layers=32, hidden=4096, intermediate=11008, vocab=32000, heads=32, kv_heads=32)
LLAMA2_70B = Decoder("llama2-70b", layers=80, hidden=8192, intermediate=28672, vocab=32000, heads=64, kv_heads=8)
#: small enough for real processes (tests/test_scale.py compares it with real FSDP2 ranks)
TINY = Decoder("tiny", layers=2, hidden=16, intermediate=24, vocab=40, heads=4, kv_heads=2)


class Arena:
    """Tensors of any shape over one allocation that is never touched (no resident memory)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        numel = math.prod(shape)
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        if self._buffer.numel() < numel:
            self._buffer = torch.empty(numel)
        return self._buffer[:numel].view(shape).to(dtype) if dtype is not torch.float32 else self._buffer[:numel].view(shape)


@dataclass
class Sharded:
    """A DTensor placeholder: a parameter (or its Adam state) under ``fully_shard``, Shard(0)."""

    shape: tuple[int, ...]


def adam_param_group() -> dict[str, Any]:
    """Adam's param_groups[0] as this torch writes it (without ``params``)."""
    group = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    return {k: v for k, v in group.items() if k != "params"}


def progress(step: int) -> dict[str, Any]:
    return {"num_epochs_completed": 0, "num_steps_completed": step, "num_steps_completed_in_epoch": step}


def app_state(layout: str, model: Decoder, arena: Arena, step: int) -> dict[str, Any]:
    """One rank's state dicts (key -> state dict), as the saver flattens them."""
    params = model.parameters()
    group = adam_param_group()
    rng = RNGState().state_dict()
    if layout == "ddp":
        weights = OrderedDict((name, arena.tensor(shape)) for name, shape in params)  # Module.state_dict()
        state = {
            i: {"step": torch.tensor(float(step)), "exp_avg": arena.tensor(shape), "exp_avg_sq": arena.tensor(shape)}
            for i, (_name, shape) in enumerate(params)
        }
        optim = {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}
    else:  # fsdp2: get_optimizer_state_dict's layout, keyed by parameter names
        weights = OrderedDict((name, Sharded(shape)) for name, shape in params)
        state = {
            name: {"step": torch.tensor(float(step)), "exp_avg": Sharded(shape), "exp_avg_sq": Sharded(shape)}
            for name, shape in params
        }
        optim = {"state": state, "param_groups": [{**group, "params": [name for name, _s in params]}]}
    return {"model": weights, "optimizer": optim, "train_progress": progress(step), "rng_state": rng}


REPLICATED = {"ddp": ["model/**", "optimizer/**"]}


# --- one rank's records, as the writer makes them ---------------------------------------------


@dataclass
class RankPart:
    entries: dict[str, str]
    sizes: dict[str, int]
    sums: dict[str, dict[str, Any]]
    #: the whole shape of each sharded tensor (the index's "ranks")
    shapes: Optional[dict[str, list[int]]] = None


class _Sizes:
    """The writer's payloads as (file, size, checksum record) without their bytes: the record
    has the shape ``checksums.record_views`` gives (a pack: one digest per tensor)."""

    def __init__(self, salt: int) -> None:
        self.sizes: dict[str, int] = {}
        self.sums: dict[str, dict[str, Any]] = {}
        self._salt = salt

    def __call__(self, payload: fmt.Payload) -> None:
        nbytes = sum(v.nbytes for v in payload.views)
        self.sizes[payload.rel] = nbytes
        value = xxhash.xxh3_64_hexdigest(f"{payload.rel}/{self._salt}".encode())
        if payload.packed:
            bounds = payload.bounds or [0]
            if payload.bounds is None:
                for view in payload.views:
                    bounds.append(bounds[-1] + view.nbytes)
            self.sums[payload.rel] = {
                "algo": "xxh3_64", "value": value, "bounds": bounds, "digests": value * (len(bounds) - 1),
            }
        else:
            self.sums[payload.rel] = {"algo": "xxh3_64", "value": value}


def _add_dtensor(builder: Any, path: str, spec: Sharded, rank: int, world: int, arena: Arena) -> None:
    """What ``_Builder.add_dtensor`` records for this rank's Shard(0) piece of a DTensor on a
    1-D mesh of ``world`` ranks (FSDP2)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(spec.shape, (world,), [rank], [Shard(0)])
    rel = fmt._shard_rel(rank, path, offsets)
    text = builder.tensor(path, arena.tensor(tuple(sizes)), rel, False, pack=True)
    shards = [{"offsets": list(offsets), "sizes": list(sizes), "tensor": json.loads(text)}]
    dim_map = [[0]] + [[-1]] * (len(spec.shape) - 1)
    builder.dtensor_record(f"{rank}/{path}", shards, list(range(world)), dim_map, named=world > 1)


def rank_part(layout: str, model: Decoder, rank: int, world: int, step: int, arena: Arena) -> RankPart:
    """Rank ``rank``'s records, file sizes and checksum records for one save at ``step``."""
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    for key, sd in app_state(layout, model, arena, step).items():
        c, leaf = fmt.flatten(key, sd)
        containers.update(c)
        leaves.update(leaf)
    emit = _Sizes(step)
    if layout == "ddp":
        replicated = set(fmt.replicable(leaves, REPLICATED["ddp"]))
        entries = fmt.plan(containers, leaves, rank=rank, world_size=world, replicated=replicated, emit=emit).entries
        return RankPart(entries, emit.sizes, emit.sums, {})
    builder = fmt._Builder(rank, PACK_BYTES, emit)  # fmt.plan's loop, with DTensor placeholders
    for path, record in containers.items():
        builder.entries[f"{rank}/{path}"] = fmt._text(record)
    for path, value in leaves.items():
        if isinstance(value, Sharded):
            _add_dtensor(builder, path, value, rank, world, arena)
        else:
            builder.add(path, f"{rank}/{path}", value, False)
    builder.finish()
    shapes = {path: list(v.shape) for path, v in leaves.items() if isinstance(v, Sharded)}
    return RankPart(builder.entries, emit.sizes, emit.sums, shapes)


# --- measurements -----------------------------------------------------------------------------


def metadata_of(entries: list[dict[str, str]], world: int) -> tuple[bytes, Optional[list[list[Any]]]]:
    """``.snapshot_metadata`` of every rank's records (in rank order) and where each rank's group
    lies, as rank 0 commits a first save (``coordination.grouped_metadata``)."""
    rank0 = RecordDeltas(enabled=world > 1)
    zeros = [rank0.incoming(r, RecordDeltas(enabled=world > 1).outgoing(e)) for r, e in enumerate(entries)]
    views, regions = grouped_metadata(zeros, rank0.groups(world), world)
    return b"".join(bytes(v) for v in views), regions


def measured_after(setup: Callable[[], Any], fn: Callable[[Any], Any]) -> tuple[Any, float, int]:
    """:func:`measured` of ``fn(setup())``, each of the two runs on a new ``setup()``, which is
    neither timed nor traced."""
    state = setup()
    gc.collect()
    started = time.perf_counter()
    fn(state)
    seconds = time.perf_counter() - started
    del state
    state = setup()
    gc.collect()
    tracemalloc.start()
    result = fn(state)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def measured(fn: Callable[[], Any], memory: bool = True) -> tuple[Any, float, int]:
    """(result, seconds, peak bytes Python allocated meanwhile): timed without tracemalloc,
    then run again under it for the peak (0 when ``memory`` is False)."""
    gc.collect()
    started = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - started
    peak = 0
    if memory:
        del result
        gc.collect()
        tracemalloc.start()
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, seconds, peak


def s3_puts(size: int, part: int = 64 * MiB) -> int:
    """Requests to upload one file of ``size`` bytes as stores/s3.py does: one PUT, or a
    multipart upload (create, one request per part, complete) above ``part`` bytes."""
    return 1 if size <= part else 2 + -(-size // part)


def sample_ranks(world: int) -> list[int]:
    return sorted({0, 1 % world, world // 2, world - 1})


def overlapping(entry: dict, offsets: list[int], sizes: list[int]) -> list[dict]:
    """The shards of merged sharded ``entry`` a target piece (``offsets``, ``sizes``) reads."""
    out = []
    for shard in entry.get("shards") or ():
        if all(
            o < t + s and t < o + n
            for o, n, t, s in zip(shard["offsets"], shard["sizes"], offsets, sizes, strict=True)
        ) and all(sizes) and all(shard["sizes"]):
            out.append(shard)
    return out


def box(shape: list[int], rank: int, world: int) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of rank ``rank``'s Shard(0) piece of a tensor of ``shape`` over ``world``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    sizes, offsets = _compute_local_shape_and_global_offset(shape, (world,), [rank], [Shard(0)])
    return list(offsets), list(sizes)


def shard_reads(view: dict[str, dict], rank: int, new_world: int) -> int:
    """How many saved shards rank ``rank`` of ``new_world`` reads for the sharded entries of ``view``."""
    reads = 0
    for entry in view.values():
        if entry["type"] in mf.SHARDED_TYPES:
            reads += len(overlapping(entry, *box(mf.global_shape(entry) or [], rank, new_world)))
    return reads


def plan_restore(data: bytes, rank: int, new_world: int) -> int:
    """One rank's restore planning in a world of ``new_world`` as restore does it: parse and
    validate the whole metadata, the rank's view, and the shards each sharded entry reads."""
    meta = mf.parse_metadata(data, "scale")
    return shard_reads(mf.rank_view(meta, rank), rank, new_world)


def plan_restore_by_rank(
    read_range: Callable[[int, int], bytes], regions: rank_regions.RankRegions, world: int, rank: int, new_world: int
) -> int:
    """The same by ranked groups (``format.torchsnapshot.rank_regions.read_for_rank``): rank 0's, the rank's own and
    those of the ranks whose shards it reads; -1 where they do not cover it (whole parse then)."""
    boxes = None
    if new_world != world:
        boxes = {logical: box(shape, rank, new_world) for logical, shape in regions.shapes.items()}
    got = rank_regions.read_for_rank(read_range, regions, world, rank, "scale", boxes)
    if got is None:
        return -1
    return shard_reads(got[1], rank, new_world)


def parsed_records(entries: dict[str, str]) -> dict[str, Any]:
    """One rank's records (path -> JSON text) as dicts, parsed together as its group of the
    metadata is: the mesh names (format/mesh_aliases.py) resolve."""
    return mesh_aliases.loads(("{" + ", ".join(f"{json.dumps(p)}: {t}" for p, t in entries.items()) + "}").encode())


def needed_ranks(zero: RankPart, world: int, rank: int, new_world: int) -> set[int]:
    """The saved ranks whose groups ``read_for_rank`` reads (its rule, from rank 0's records)."""
    out = {0} | ({rank} if rank < world else set())
    if new_world == world:
        return out
    records = parsed_records(zero.entries)
    for logical, shape in (zero.shapes or {}).items():
        offsets, sizes = box(shape, rank, new_world)
        chunk = records[f"0/{logical}"]["shards"][0]["sizes"][0]
        if chunk and sizes[0]:
            out.update(range(offsets[0] // chunk, min((offsets[0] + sizes[0] - 1) // chunk, world - 1) + 1))
    return out


def by_rank(point: Point, layout: str, model: Decoder, world: int, arena: Arena) -> None:
    """Restore planning of one rank by ranked groups, at any N: the metadata holds the groups of
    the ranks it reads (the others' are empty), laid out and indexed as the commit does."""
    rank = world // 2 - 1 if world > 1 else 0
    zero = rank_part(layout, model, 0, world, 1, arena)
    point.by_rank_s, point.by_rank_peak, point.by_rank_groups = {}, {}, {}
    for label, new_world in (("N", world), ("N/2", max(1, world // 2)), ("2N", 2 * world)):
        target = min(rank, new_world - 1)
        ranks = needed_ranks(zero, world, target, new_world)
        parts = [zero.entries if r == 0 else rank_part(layout, model, r, world, 1, arena).entries if r in ranks else {}
                 for r in range(world)]
        data, ranked = metadata_of(parts, world)
        regions = rank_regions.RankRegions.from_index({"ranks": {"regions": ranked, "shapes": zero.shapes}})
        assert regions is not None
        reads, seconds, peak = measured(
            lambda t=target, m=new_world, r=regions, d=data: plan_restore_by_rank(lambda a, b: d[a:b], r, world, t, m)
        )
        assert reads >= 0, f"{layout} N={world} -> {new_world}: the groups read do not cover rank {target}"
        point.by_rank_s[label], point.by_rank_peak[label] = seconds, peak
        point.by_rank_groups[label] = len(ranks)


@dataclass
class Point:
    layout: str
    world: int
    records_per_rank: int = 0
    files_per_rank: int = 0
    packs_per_rank: int = 0  # files in batched/ (one directory for every rank's packs)
    s3_puts_per_rank: int = 0  # requests to upload them and its part of the index on S3 (multipart above 64 MiB)
    part_first_bytes: int = 0  # what one rank sends rank 0 at the first save
    part_later_bytes: int = 0  # ... at a later save (RecordDeltas)
    part_before_bytes: int = 0  # ... at every save, before RecordDeltas
    later_records: int = 0
    rank_sim_s: float = 0.0
    metadata_bytes: float = 0.0
    index_bytes: float = 0.0
    commit_first_s: float = 0.0  # rank 0's commit of a first save (every group sent whole)
    commit_first_peak: float = 0.0
    commit_s: float = 0.0  # ... of a later one (each group's changes applied)
    commit_peak: float = 0.0
    store_commit_s: float = 0.0
    store_estimated: bool = False  # from the time per directory of a smaller commit
    directories: float = 0
    latest_s: float = 0.0
    latest_peak: float = 0.0
    latest_ranked_s: float = 0.0  # as restore_from_latest checks on N ranks (streamed checksum)
    latest_ranked_peak: float = 0.0
    index_parse_s: float = 0.0  # every restoring rank's parse of the index (O(N): the parts' list)
    index_parse_peak: float = 0.0
    index_part_bytes: int = 0  # one rank's part of the index (its files' sizes and checksums)
    index_part_parse_s: float = 0.0  # a restoring rank's parse of its part
    index_part_parse_peak: float = 0.0
    restore_s: dict[str, float] | None = None
    restore_peak: dict[str, float] | None = None
    by_rank_s: dict[str, float] | None = None
    by_rank_peak: dict[str, float] | None = None
    by_rank_groups: dict[str, int] | None = None
    extrapolated: bool = False


LAYOUTS = {"ddp-7b": ("ddp", LLAMA2_7B), "fsdp2-7b": ("fsdp2", LLAMA2_7B), "fsdp2-70b": ("fsdp2", LLAMA2_70B)}


def per_rank(point: Point, layout: str, model: Decoder, world: int, arena: Arena) -> tuple[RankPart, RankPart]:
    """Sampled ranks' parts: sizes of what each sends rank 0, averaged over the sample."""
    first_b, later_b, before_b, records, files, later_records = [], [], [], [], [], []
    packs: list[int] = []
    puts: list[int] = []
    started = time.perf_counter()
    sample = sample_ranks(world) if world < 512 else [0, world // 2]
    for rank in sample:
        deltas = RecordDeltas()
        first = rank_part(layout, model, rank, world, 1, arena)
        sent = deltas.outgoing(first.entries)
        first_b.append(len(pickle.dumps((sent, rank_listing(first, world)))))
        deltas.settle()
        later = rank_part(layout, model, rank, world, 2, arena)
        sent = deltas.outgoing(later.entries)
        later_records.append(deltas.last_sent_records)
        later_b.append(len(pickle.dumps((sent, rank_listing(later, world)))))
        before_b.append(len(pickle.dumps((later.entries, later.sizes, later.sums))))
        records.append(len(first.entries))
        files.append(len(first.sizes))
        packs.append(sum(1 for rel in first.sizes if rel.startswith("batched/")))
        puts.append(sum(s3_puts(size) for size in first.sizes.values()) + (world > 1))  # and its part of the index
    point.rank_sim_s = (time.perf_counter() - started) / (2 * len(sample))
    mean = lambda xs: int(sum(xs) / len(xs))  # noqa: E731
    point.part_first_bytes, point.part_later_bytes, point.part_before_bytes = mean(first_b), mean(later_b), mean(before_b)
    point.records_per_rank, point.files_per_rank, point.later_records = mean(records), mean(files), mean(later_records)
    point.packs_per_rank, point.s3_puts_per_rank = mean(packs), mean(puts)
    # a restoring rank's part of the index, read and parsed (restoring.files.reading_io)
    data = part_bytes(later.sizes, later.sums)
    point.index_part_bytes = len(data)
    index = {"parts": [part_entry(data) if r == sample[-1] else [0, ""] for r in range(world)]}
    _, point.index_part_parse_s, point.index_part_parse_peak = measured(
        lambda: parse_part(data, index, sample[-1], "scale")
    )
    return first, later


def rank_listing(part: RankPart, world: int) -> Any:
    """What a rank sends rank 0 of its files (writer_job): on several ranks, what the index lists
    of the part the rank wrote (its size and digest) and the bytes of its files."""
    if world == 1:
        return part.sizes, part.sums
    return part_entry(part_bytes(part.sizes, part.sums)), sum(part.sizes.values())


#: Above this many directories a local-disk commit (one fsync each) is not run but extrapolated.
MAX_DIRECTORIES = 4000


def whole(point: Point, layout: str, model: Decoder, world: int, arena: Arena, root: Path,
          store_base: list[Point]) -> None:
    """Rank 0's commit, latest selection and restore planning, on every rank's records."""
    parts = [rank_part(layout, model, rank, world, 1, arena) for rank in range(world)]
    # what each rank sends at a first save and at a later one (coordination.RecordDeltas)
    senders = [RecordDeltas() for _ in range(world)]
    first = [deltas.outgoing(p.entries) for deltas, p in zip(senders, parts, strict=True)]
    for deltas in senders:
        deltas.settle()
    later = [deltas.outgoing(rank_part(layout, model, r, world, 2, arena).entries) for r, deltas in enumerate(senders)]
    del senders
    store = open_store(str(root))
    final = "epoch_0_step_1"
    staging = store.protocol.staging_for(final, "scale0")
    shutil.rmtree(root / final, ignore_errors=True)
    store.begin(staging, {"host": "scale", "pid": 0})
    listings = []
    for rank, p in enumerate(parts):  # the payload files, as the ranks left them (sparse: sizes only)
        for rel, size in p.sizes.items():
            target = root / staging / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as f:
                f.truncate(size)
        data = part_bytes(p.sizes, p.sums)  # and its part of the index
        (root / staging / part_rel(rank)).parent.mkdir(exist_ok=True)
        (root / staging / part_rel(rank)).write_bytes(data)
        listings.append(part_entry(data))
    gc.collect()
    before_commit = [p for p in root.iterdir()]

    def commit(rank0: RecordDeltas, sent: list[Any]) -> tuple[list[Any], bytes]:
        """Rank 0's part of writer_job's commit: the metadata's buffers and the index."""
        zeros = [rank0.incoming(rank, part) for rank, part in enumerate(sent)]
        metadata, regions = grouped_metadata(zeros, rank0.groups(world), world)
        fields = {"format": PARTED_FORMAT, "epoch": 0, "step": 1, "files": {}, "seq": 1, "world_size": world,
                  "committed_at": 0.0, "writer": {}, "checksums": {METADATA_FNAME: record_whole(metadata)},
                  "parts": listings, "ranks": {"regions": regions, "shapes": parts[0].shapes}}
        return metadata, seal(fields)

    def settled() -> RecordDeltas:  # rank 0 after the first save
        rank0 = RecordDeltas()
        commit(rank0, first)
        rank0.settle()
        return rank0

    _, point.commit_first_s, point.commit_first_peak = measured(lambda: commit(RecordDeltas(), first))
    (metadata, index), point.commit_s, point.commit_peak = measured_after(settled, lambda r: commit(r, later))
    point.metadata_bytes, point.index_bytes = sum(len(v) for v in metadata), len(index)
    # every restoring rank reads the index (then its part: per_rank)
    _, point.index_parse_s, point.index_parse_peak = measured(lambda data=index: parse_index(data, "scale"))
    point.directories = sum(1 for _ in os.walk(root / staging))
    if point.directories <= MAX_DIRECTORIES or not store_base:
        fields = json.loads(index)
        written = dict(fields["files"])  # and each rank's part of the index
        written.update((part_rel(r), p[0]) for r, p in enumerate(fields.get("parts") or []))
        started = time.perf_counter()
        store.commit(  # checks every file's size, fsyncs, renames
            staging, final, metadata_file=METADATA_FNAME, metadata=metadata, index_file=INDEX_FNAME, index=index,
            written=written,
        )
        point.store_commit_s = time.perf_counter() - started
        store_base.append(point)
    else:  # in proportion to the directories fsynced, from the largest point measured
        base = store_base[-1]
        point.store_commit_s = base.store_commit_s * point.directories / base.directories
        point.store_estimated = True
        os.rename(root / staging, root / final)
        with open(root / final / METADATA_FNAME, "wb") as f:
            f.writelines(metadata)
        (root / final / INDEX_FNAME).write_bytes(index)
    del before_commit, metadata, index
    for held in (first, later, parts):
        held.clear()
    gc.collect()

    def latest() -> bool:
        store = open_store(str(root))
        newest = listing.listed(store)[-1]
        return verify.check(store, newest.text).intact

    intact, point.latest_s, point.latest_peak = measured(latest)
    assert intact, "the simulated snapshot does not verify"

    def latest_ranked() -> bool:
        store = open_store(str(root))
        newest = listing.listed(store)[-1]
        return verify.check(store, newest.text, restoring_ranks=world).intact

    intact, point.latest_ranked_s, point.latest_ranked_peak = measured(latest_ranked)
    assert intact, "the simulated snapshot does not verify"
    data = (root / "epoch_0_step_1" / METADATA_FNAME).read_bytes()
    point.restore_s, point.restore_peak = {}, {}
    rank = world // 2 - 1 if world > 1 else 0
    for label, new_world in (("N", world),):
        target = min(rank, new_world - 1)
        _reads, seconds, peak = measured(lambda t=target, m=new_world: plan_restore(data, t, m))
        point.restore_s[label], point.restore_peak[label] = seconds, peak


def predicted_metadata(point: Point, world: int) -> float:
    """The metadata's size: every rank's records (their text, as a rank's part carries it)."""
    return point.part_before_bytes * world


def extrapolate(point: Point, base: Point) -> None:
    """Whole-snapshot costs at ``point`` from measured ``base``, proportional to metadata size."""
    scale = point.metadata_bytes / base.metadata_bytes
    point.extrapolated = True
    point.index_bytes = base.index_bytes * point.world / base.world
    index_scale = point.index_bytes / base.index_bytes
    point.index_parse_s, point.index_parse_peak = base.index_parse_s * index_scale, base.index_parse_peak * index_scale
    point.commit_first_s, point.commit_s = base.commit_first_s * scale, base.commit_s * scale
    # what a commit allocates: rank 0's own group, the lists of N groups' buffers, the index
    point.commit_first_peak = base.commit_first_peak * point.world / base.world
    point.commit_peak = base.commit_peak * point.world / base.world
    # a file of its own (not a pack) sits in a directory of its own (RANK/<path>/shard_...)
    own = max(1, base.files_per_rank - base.packs_per_rank) * base.world
    point.directories = base.directories * max(1, point.files_per_rank - point.packs_per_rank) * point.world / own
    point.store_commit_s = base.store_commit_s * point.directories / base.directories
    point.latest_s, point.latest_peak = base.latest_s * scale, base.latest_peak * scale
    point.latest_ranked_s = base.latest_ranked_s * scale  # the metadata streamed through its checksum
    # ... READ_CHUNK at a time (verify.py): of its peak only the index's parse grows
    point.latest_ranked_peak = base.latest_ranked_peak + point.index_parse_peak - base.index_parse_peak
    point.restore_s = {k: v * scale for k, v in (base.restore_s or {}).items()}
    point.restore_peak = {k: v * scale for k, v in (base.restore_peak or {}).items()}


def run(layouts: list[str], worlds: list[int], max_metadata: float, log: Callable[[str], None]) -> list[Point]:
    points: list[Point] = []
    arena = Arena()
    root = Path(tempfile.mkdtemp(prefix="tnt-scale-"))
    try:
        store_base: list[Point] = []  # the fsync of a directory costs the same whatever the layout
        for name in layouts:
            layout, model = LAYOUTS[name]
            base: Optional[Point] = None
            for world in worlds:
                point = Point(name, world)
                per_rank(point, layout, model, world, arena)
                by_rank(point, layout, model, world, arena)
                point.metadata_bytes = predicted_metadata(point, world)
                if point.metadata_bytes <= max_metadata:
                    whole(point, layout, model, world, arena, root, store_base)
                    base = point
                elif base is not None:
                    extrapolate(point, base)
                points.append(point)
                log(row(point))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return points


# --- report -----------------------------------------------------------------------------------


def human(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def secs(s: float) -> str:
    return f"{s * 1000:.3g} ms" if s < 1 else f"{s:.3g} s"


HEADER = (
    "| layout | N | records / rank | to rank 0 per save: before / first / later (one rank) | "
    "gathered to rank 0, later saves | .snapshot_metadata | rank 0 commit (metadata, index), first / "
    "later save: time, peak | local disk commit (directories fsynced) | index + each rank's part | latest: time, peak (whole parse / "
    "checked for N ranks) | "
    "restore planning, whole metadata: time, peak | restore planning by rank N / N/2 / 2N: time "
    "(groups read) | peak | index + own part, parsed by every rank at restore: time, peak |\n|" + "---|" * 14
)


def row(p: Point) -> str:
    mark = "~" if p.extrapolated else ""
    restore = " / ".join(mark + secs(v) for v in (p.restore_s or {}).values()) or "-"
    restore_peak = mark + human(max((p.restore_peak or {0: 0}).values()))
    groups = p.by_rank_groups or {}
    store = "~" if p.extrapolated or p.store_estimated else ""
    by_rank = " / ".join(f"{secs(v)} ({groups.get(k, 0)})" for k, v in (p.by_rank_s or {}).items())
    by_rank_peak = human(max((p.by_rank_peak or {0: 0}).values()))
    return (
        f"| {p.layout} | {p.world} | {p.records_per_rank} | {human(p.part_before_bytes)} / "
        f"{human(p.part_first_bytes)} / {human(p.part_later_bytes)} ({p.later_records} records) | "
        f"{human(p.part_later_bytes * p.world)} | {mark}{human(p.metadata_bytes)} | "
        f"{mark}{secs(p.commit_first_s)}, {mark}{human(p.commit_first_peak)} / "
        f"{mark}{secs(p.commit_s)}, {mark}{human(p.commit_peak)} | "
        f"{store}{secs(p.store_commit_s)} ({mark}{int(p.directories)}) | {mark}{human(p.index_bytes)} + "
        f"{human(p.index_part_bytes)} | "
        f"{mark}{secs(p.latest_s)}, {mark}{human(p.latest_peak)} / {mark}{secs(p.latest_ranked_s)}, "
        f"{mark}{human(p.latest_ranked_peak)} | {restore}, {restore_peak} | "
        f"{by_rank} | {by_rank_peak} | {mark}{secs(p.index_parse_s)} + {secs(p.index_part_parse_s)}, "
        f"{mark}{human(p.index_parse_peak)} + {human(p.index_part_parse_peak)} |"
    )


def plot(points: list[Point], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    # (title, the solid line, the dashed one, its label, which line holds extrapolated points)
    figures = {
        "scale_gathered.png": ("bytes sent to rank 0 per later save (all ranks)", lambda p: p.part_later_bytes * p.world,
                               lambda p: p.part_before_bytes * p.world, "every record, every save", None),
        "scale_metadata.png": (".snapshot_metadata bytes", lambda p: p.metadata_bytes, None, "", "solid"),
        "scale_commit.png": ("rank 0 commit (metadata, index) of a later save, seconds", lambda p: p.commit_s,
                             lambda p: p.commit_first_s, "first save",
                             "solid"),
        "scale_restore.png": ("restore planning of one rank (N -> N), seconds",
                              lambda p: (p.by_rank_s or {}).get("N", 0.0),
                              lambda p: (p.restore_s or {}).get("N", 0.0), "whole metadata", "dashed"),
    }
    written = []
    for fname, (title, value, before, before_label, estimated) in figures.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for layout in dict.fromkeys(p.layout for p in points):
            mine = [p for p in points if p.layout == layout and value(p) > 0]
            if not mine:
                continue
            (line,) = ax.plot([p.world for p in mine], [value(p) for p in mine], marker="o", label=layout)
            if before is not None:
                ax.plot([p.world for p in mine], [before(p) for p in mine], linestyle="--",
                        color=line.get_color(), label=f"{layout}, {before_label}")
            est = [p for p in mine if p.extrapolated]
            if est and estimated is not None:
                series = value if estimated == "solid" else before
                assert series is not None
                ax.plot([p.world for p in est], [series(p) for p in est], "x", color=line.get_color(), markersize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (N)")
        marked = estimated is not None and any(p.extrapolated for p in points)
        ax.set_title(title + ("  (x: extrapolated)" if marked else ""), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / fname
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 8 and 64, ddp-7b and fsdp2-7b, 8 MiB")
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS))
    parser.add_argument("--worlds", nargs="+", type=int)
    parser.add_argument("--max-metadata", type=float, default=32 * MiB,
                        help="measure whole-snapshot costs up to this many metadata bytes (default 32 MiB)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/scale.json"))
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--plots", type=Path, help="directory for the log-log plots (e.g. docs/img)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    layouts = args.layouts or (["ddp-7b", "fsdp2-7b"] if args.quick else list(LAYOUTS))
    worlds = args.worlds or ([8, 64] if args.quick else [8, 64, 512, 1024, 4096])
    max_metadata = args.max_metadata if not args.quick else min(args.max_metadata, 8 * MiB)
    print(HEADER, flush=True)
    started = time.perf_counter()
    points = run(layouts, worlds, max_metadata, lambda line: print(line, flush=True))
    print(f"\n({time.perf_counter() - started:.0f} s; ~: extrapolated from the largest measured N, "
          "in proportion to the metadata's size)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([p.__dict__ for p in points], indent=1))
    if args.markdown:
        args.markdown.write_text(HEADER + "\n" + "\n".join(row(p) for p in points) + "\n")
    if args.plots:
        for path in plot(points, args.plots):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
