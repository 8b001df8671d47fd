"""The plugin's writer of torchsnapshot's format (tnt_snapshot_plugin/format/writer.py).

What it writes is restored by STOCK torchsnapshot in subprocesses that never import the plugin
(tests/stock_reader.py), and compared bitwise with what was saved: one process for every
single-rank entry kind, two gloo processes for replicated values, DTensors and ShardedTensors
(written by tests/format_writer_worker.py). Unit tests compare :func:`writer.flatten` with
torchsnapshot's own ``flatten`` and check that locations stay inside the snapshot directory.
"""

from __future__ import annotations

import functools
import json
import posixpath
import subprocess
import sys
import warnings
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import launching
import numpy as np
import pytest
import torch
from stock_reader import REPLICATED, same
from torchsnapshot.flatten import flatten as stock_flatten

from tnt_snapshot_plugin.errors import ConfigError, SnapshotError
from tnt_snapshot_plugin.format.torchsnapshot import merging, mesh_aliases, plan_cache, writer
from tnt_snapshot_plugin.format.torchsnapshot.common import (
    DTYPE_NAMES,
    FORMAT_VERSION,
    METADATA_FNAME,
    RAW,
    TORCH_SAVE,
)

HERE = Path(__file__).parent


def write_snapshot(root: Path, plans: list[writer.Plan], world_size: int = 1) -> dict[str, dict]:
    """Write the plans' payloads with plain file writes, then the merged manifest (returned
    parsed: path -> record dict)."""
    for plan in plans:
        for payload in plan.payloads:
            path = root / payload.rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                for view in payload.views:
                    f.write(view)
    manifest = writer.merge([plan.entries for plan in plans])
    (root / METADATA_FNAME).write_bytes(writer.metadata_bytes(manifest, world_size))
    return {path: json.loads(record) for path, record in manifest.items()}


def plan_for(state: dict[str, Any], **kwargs: Any) -> writer.Plan:
    containers: dict[str, dict] = {}
    leaves: dict[str, Any] = {}
    for key, state_dict in state.items():
        more_containers, more_leaves = writer.flatten(key, state_dict)
        containers.update(more_containers)
        leaves.update(more_leaves)
    kwargs.setdefault("rank", 0)
    kwargs.setdefault("world_size", 1)
    kwargs.setdefault("replicated", set())
    return writer.plan(containers, leaves, **kwargs)


def every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for dtype in DTYPE_NAMES:
        name = str(dtype).removeprefix("torch.")
        if dtype.is_floating_point or dtype.is_complex:
            out[name] = torch.randn(5, 3, generator=gen, dtype=dtype)
        elif dtype is torch.bool:
            out[name] = torch.randn(7, generator=gen) > 0
        elif dtype in (torch.qint8, torch.quint8, torch.qint32):
            with warnings.catch_warnings():  # torch deprecates quantized dtypes; the format keeps them
                warnings.simplefilter("ignore", UserWarning)
                out[name] = torch.quantize_per_tensor(torch.randn(6, generator=gen), 0.1, 3, dtype)
        else:
            out[name] = torch.randint(-100 if dtype is not torch.uint8 else 0, 100, (4, 2), generator=gen, dtype=dtype)
    return out


def single_rank_state() -> dict[str, Any]:
    big = torch.arange(1000.0)
    return {
        "tensors": {
            **{name: t for name, t in every_dtype().items() if not t.is_quantized},
            "bf16_odd": torch.arange(7, dtype=torch.bfloat16) / 3,
            "empty": torch.empty(0),
            "empty_2d": torch.empty(2, 0),
            "empty_3d_int": torch.zeros(0, 3, 4, dtype=torch.int64),
            "empty_complex": torch.empty(0, 2, dtype=torch.complex64),
            "scalar": torch.tensor(3.5),
            "noncontig": torch.arange(24.0).reshape(4, 6).t()[1:],
            "grad": torch.ones(3, requires_grad=True) * 2,
            "param": torch.nn.Parameter(torch.full((2, 2), 0.5)),
            "view_of_big": big[10:20],
            "complex_view": torch.arange(20.0).to(torch.complex64)[2:5],
            "big": torch.arange(600.0),  # > pack_bytes: a file of its own
            "big_bf16_odd": torch.arange(1001, dtype=torch.bfloat16),
        },
        "quantized": {name: t for name, t in every_dtype().items() if t.is_quantized},
        "prims": {
            "int": 3,
            "huge": -(10**30),
            "str": "héllo wörld",
            "empty_str": "",
            "bool": True,
            "float": 0.1,
            "inf": float("-inf"),
            "bytes": b"\x00\xffab",
        },
        "objects": {
            "tuple": (1, "a", 2.5),
            "set": {1, 2, 3},
            "none": None,
            "tuple_keys": {(1, 2): 3},
            "colliding_keys": {1: "int", "1": "str"},
            "ordered": OrderedDict(b=1, a=OrderedDict(z=torch.ones(2), y=[1, 2])),
            "nested": [1, [2, {"x": torch.zeros(3, dtype=torch.int16)}]],
            "int_keys": {0: "zero", 7: torch.ones(1)},
        },
        "odd/key%": {
            "..": torch.ones(2),
            ".": torch.zeros(2),
            "": torch.full((2,), 3.0),
            "x/../y": 4,
            "emoji 😀 \x85\u2028": torch.ones(3),  # YAML-hostile characters in the manifest
            "str 😀": "value 😀\x7f",
        },
    }


# --- stock torchsnapshot restores what the writer wrote (one subprocess for every kind) -------


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict]]:
    """(what was saved, what stock torchsnapshot restored, the manifest)."""
    root = tmp_path_factory.mktemp("single")
    state = single_rank_state()
    quantized = {"quantized": state.pop("quantized")}  # apart: see stock_reader.single
    manifest = write_snapshot(root / "snap", [plan_for(state, pack_bytes=1024)])
    manifest.update(write_snapshot(root / "snap_q", [plan_for(quantized, pack_bytes=1024)]))
    state.update(quantized)
    out = root / "restored.pt"
    proc = subprocess.run(
        [sys.executable, str(HERE / "stock_reader.py"), "single", str(out), str(root / "snap"), str(root / "snap_q")],
        capture_output=True,
        text=True,
        timeout=launching.DEADLINE_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr  # torchsnapshot logs failed reads and goes on
    return state, torch.load(out, weights_only=False), manifest


@pytest.mark.parametrize(
    "key, how",
    [(key, how) for key in ("tensors", "prims", "objects", "odd/key%") for how in ("plain", "inplace")]
    + [("quantized", "inplace")],  # torchsnapshot rebuilds quantized tensors only into quantized targets
)
def test_stock_torchsnapshot_restores_each_kind_bitwise(single_rank, key, how):
    state, restored, _ = single_rank
    saved, got = flat(state[key]), flat(restored[how][key])
    assert saved.keys() == got.keys()
    differ = [name for name in saved if not same(saved[name], got[name])]
    assert not differ, {name: (saved[name], got[name]) for name in differ}


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested containers -> path -> leaf (to compare values wherever they were stored)."""
    if type(value) in (dict, OrderedDict) and writer._is_flattenable(value):
        return {k: v for name, item in value.items() for k, v in flat(item, f"{prefix}/{name}").items()}
    if type(value) is list:
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}/{i}").items()}
    return {prefix: value}


def test_manifest_records_follow_torchsnapshots_schema(single_rank):
    _, _, manifest = single_rank
    tensors = {path.split("/")[-1]: entry for path, entry in manifest.items() if path.startswith("0/tensors/")}
    assert tensors["float32"] == {
        "type": "Tensor",
        "location": tensors["float32"]["location"],
        "serializer": RAW,
        "dtype": "torch.float32",
        "shape": [5, 3],
        "replicated": False,
        "byte_range": tensors["float32"]["byte_range"],
    }
    assert tensors["float32"]["location"].startswith("batched/")
    assert tensors["big"]["location"] == "0/tensors/big" and tensors["big"]["byte_range"] is None
    assert {tensors[n]["serializer"] for n in ("complex64", "empty", "empty_3d_int")} == {TORCH_SAVE}
    assert manifest["0/quantized/qint8"]["serializer"] == TORCH_SAVE
    assert tensors["bf16_odd"]["serializer"] == RAW and tensors["bf16_odd"]["byte_range"][1] - tensors["bf16_odd"]["byte_range"][0] == 14
    assert manifest["0/prims/float"] == {
        "type": "float",
        "serialized_value": "mpmZmZmZuT8=",
        "replicated": False,
        "readable": "0.1",
    }
    assert manifest["0/prims/int"]["readable"] is None
    assert manifest["0/objects/tuple"]["obj_type"] == "builtins.tuple"
    assert manifest["0/objects/ordered"] == {"type": "OrderedDict", "keys": ["b", "a"]}
    assert manifest["0/objects/int_keys"] == {"type": "dict", "keys": [0, 7]}
    assert manifest["0/objects/nested"] == {"type": "list"}


def test_small_tensors_are_packed_and_views_are_zero_copy():
    tensors = {f"t{i}": torch.full((64,), float(i)) for i in range(40)}  # 256 bytes each
    plan = plan_for({"m": tensors}, pack_bytes=1024)
    packs = [p for p in plan.payloads if p.rel.startswith("batched/")]
    assert len(packs) == 10 and all(sum(v.nbytes for v in p.views) == 1024 for p in packs)
    assert plan.nbytes == 40 * 256
    tensors["t0"].fill_(-1.0)  # the views are over the tensors' own memory
    assert bytes(packs[0].views[0]) == torch.full((64,), -1.0).numpy().tobytes()
    ranges = [json.loads(plan.entries[f"0/m/t{i}"])["byte_range"] for i in range(4)]
    assert ranges == [[0, 256], [256, 512], [512, 768], [768, 1024]]


def test_each_payload_is_handed_out_as_soon_as_it_is_complete():
    """With ``emit``, a full pack (and a file of its own at once) goes to the caller while the
    rest of the state is still being planned, so that it is written meanwhile."""

    class Counting(dict):  # counts the leaves plan() has taken so far
        taken = 0

        def items(self):
            for item in super().items():
                self.taken += 1
                yield item

    leaves = Counting({f"m/t{i}": torch.full((64,), float(i)) for i in range(40)})  # 256 bytes each
    leaves["m/big"] = torch.zeros(1000)  # 4000 bytes: a file of its own
    emitted = []
    plan = writer.plan({}, leaves, rank=0, world_size=1, replicated=set(), pack_bytes=1024,
                       emit=lambda p: emitted.append((p.rel, leaves.taken, sum(v.nbytes for v in p.views))))
    assert plan.payloads == [] and plan.nbytes == 40 * 256 + 4000
    # pack N is full when the 4(N+1)+1-th tensor comes; the big one at once; the last pack at the end
    assert emitted[:3] == [("batched/0-0", 5, 1024), ("batched/0-1", 9, 1024), ("batched/0-2", 13, 1024)]
    assert emitted[-2:] == [("0/m/big", 41, 4000), ("batched/0-9", 41, 1024)]
    assert len(emitted) == 11


# --- PlanCache: a plan of an unchanged layout is reused --------------------------------------


def cacheable_state(seed: int) -> dict[str, Any]:
    """Tensors of several dtypes and shapes (packed, and one in a file of its own between
    packed ones), numbers and objects: a layout a PlanCache reuses, with values from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"w{i}": torch.randn(40 + i, generator=gen) for i in range(30)}
    state["big"] = torch.randn(50, 30, generator=gen)  # 6000 bytes: a file of its own
    state["bf16"] = torch.randn(5, 3, generator=gen).to(torch.bfloat16)
    state["ints"] = torch.randint(0, 9, (7,), generator=gen, dtype=torch.int16)
    state["step"] = seed
    state["rng"] = ("object", seed)
    state["more"] = [torch.full((3,), float(seed)), {"lr": 0.1 * seed}]
    return state


def full_and_cached(states: list[dict[str, Any]], **kwargs: Any) -> tuple[list[writer.Plan], writer.PlanCache]:
    cache = writer.PlanCache()
    return [plan_for({"m": state}, pack_bytes=1024, cache=cache, **kwargs) for state in states], cache


def same_plan(got: writer.Plan, want: writer.Plan) -> None:
    """The same records (as dicts: a reused plan lists them in another order) and the same files
    with the same bytes."""
    assert {p: json.loads(r) for p, r in got.entries.items()} == {p: json.loads(r) for p, r in want.entries.items()}
    files = lambda plan: {p.rel: b"".join(bytes(v) for v in p.views) for p in plan.payloads}  # noqa: E731
    assert files(got) == files(want) and got.nbytes == want.nbytes


def test_a_plan_of_an_unchanged_layout_is_reused_with_the_new_values():
    (first, second, third), cache = full_and_cached([cacheable_state(0), cacheable_state(1), cacheable_state(2)])
    assert (cache.misses, cache.hits) == (1, 2)
    same_plan(second, plan_for({"m": cacheable_state(1)}, pack_bytes=1024))  # new bytes, new numbers
    same_plan(third, plan_for({"m": cacheable_state(2)}, pack_bytes=1024))
    assert json.loads(third.entries["0/m/step"])["serialized_value"] == "2"


CHANGES = {
    "a shape": lambda s: s.update(w3=torch.zeros(44)),
    "a dtype": lambda s: s.update(w3=s["w3"].double()),
    "a key added": lambda s: s.update(extra=torch.ones(2)),
    "a key removed": lambda s: s.pop("w3"),
    "the order": lambda s: s.update(w0=s.pop("w0")),
    "a tensor became a number": lambda s: s.update(w3=3),
    "a number became a tensor": lambda s: s.update(step=torch.ones(1)),
    "a non-contiguous tensor": lambda s: s.update(big=s["big"].t().contiguous().t()),
    "an empty tensor": lambda s: s.update(w3=torch.empty(0)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_layout_is_planned_in_full(change):
    changed = cacheable_state(1)
    CHANGES[change](changed)
    (_, plan, again), cache = full_and_cached([cacheable_state(0), changed, changed])
    same_plan(plan, plan_for({"m": changed}, pack_bytes=1024))
    same_plan(again, plan_for({"m": changed}, pack_bytes=1024))
    reusable = change not in ("a non-contiguous tensor", "an empty tensor")  # a copy, torch.save bytes
    assert (cache.misses, cache.hits) == ((2, 1) if reusable else (3, 0))


def test_replicated_values_and_another_rank_are_planned_in_full():
    (_, plan), cache = full_and_cached([cacheable_state(0), cacheable_state(1)], replicated={"m/w1"})
    assert (cache.misses, cache.hits) == (0, 0)  # not even looked up
    cache = writer.PlanCache()
    plan_for({"m": cacheable_state(0)}, pack_bytes=1024, cache=cache, rank=0)
    other_rank = plan_for({"m": cacheable_state(1)}, pack_bytes=1024, cache=cache, rank=1, world_size=2)
    assert (cache.misses, cache.hits) == (2, 0)
    same_plan(other_rank, plan_for({"m": cacheable_state(1)}, pack_bytes=1024, rank=1, world_size=2))


def arena_state(seed: int) -> dict[str, Any]:
    """Packed tensors of which most lie end to end in one flat tensor (as an asynchronous
    snapshot's staging arena holds them), broken by one tensor of its own memory and by a
    bfloat16 arena of its own; each pack of 1024 bytes mixes them."""
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randn(30 * 24, generator=gen)
    halves = torch.randn(4 * 6, generator=gen).to(torch.bfloat16)
    state: dict[str, Any] = {f"a{i}": arena[i * 24:(i + 1) * 24].view(4, 6) for i in range(30)}  # 96 bytes each
    state["a7"] = torch.randn(4, 6, generator=gen)  # apart, in the middle of a run
    state.update({f"h{i}": halves[i * 6:(i + 1) * 6] for i in range(4)})  # 12 bytes each
    state["step"] = seed
    return state


def test_tensors_end_to_end_in_memory_are_handed_out_as_one_view_with_the_same_bytes_and_checksums():
    from tnt_snapshot_plugin.format.checksums import record_views

    (_, plan), cache = full_and_cached([arena_state(0), arena_state(1)])
    assert (cache.misses, cache.hits) == (1, 1)
    full = plan_for({"m": arena_state(1)}, pack_bytes=1024)
    same_plan(plan, full)  # the same records, files and bytes
    packs = {p.rel: p for p in plan.payloads if p.packed}
    assert len(packs) == 3 and cache.runs == 3
    for want in full.payloads:
        got = packs[want.rel]
        assert got.bounds is not None and len(got.views) < len(got.bounds) - 1  # runs, not a view a tensor
        assert record_views(got.views, got.bounds) == record_views(want.views)  # one digest a tensor
    # the tensor apart from the arena is a view of its own, between two runs
    first = packs["batched/0-0"]
    assert [v.nbytes for v in first.views] == [7 * 96, 96, 2 * 96]


def apart_state(seed: int) -> dict[str, Any]:
    """Packs (of 1024 bytes) of tensors that each have memory of their own (a model's
    parameters): float32 1-D, float32 2-D, bfloat16, and one pack that mixes dtypes."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"v{i}": torch.randn(40, generator=gen) for i in range(12)}  # 2 packs of 6 x 160 B
    state.update({f"g{i}": torch.randn(4, 6, generator=gen) for i in range(12)})  # 10 x 96 B, then 2 ...
    state["mixed"] = torch.arange(400, dtype=torch.int16)  # ... with 800 B of int16: dtypes mixed
    state.update({f"h{i}": torch.randn(100, generator=gen).to(torch.bfloat16) for i in range(5)})  # 5 x 200 B
    state["step"] = seed
    return state


def test_a_reused_plan_gathers_packs_of_tensors_apart_into_one_buffer_with_the_same_bytes_and_checksums():
    """Each pack of one dtype is copied into the PackBuffer (reused from pack to pack: the
    emit consumes each at once); the files, their bytes and their checksum records are those of
    a plan made in full, with a view a tensor."""
    from tnt_snapshot_plugin.format.checksums import record_views

    def take(files: dict[str, tuple[bytes, Any, int]], p: writer.Payload) -> None:  # as written: at once
        files[p.rel] = (b"".join(bytes(v) for v in p.views), record_views(p.views, p.bounds), len(p.views))

    cache, buffer = writer.PlanCache(), writer.PackBuffer()
    for seed in range(3):
        files: dict[str, tuple[bytes, Any, int]] = {}  # rel -> (bytes, checksum record, views)
        plan = plan_for({"m": apart_state(seed)}, pack_bytes=1024, cache=cache, pack_buffer=buffer,
                        emit=functools.partial(take, files))
        full = plan_for({"m": apart_state(seed)}, pack_bytes=1024)
        assert {p: json.loads(r) for p, r in plan.entries.items()} == {p: json.loads(r) for p, r in full.entries.items()}
        assert {rel: f[:2] for rel, f in files.items()} == {
            p.rel: (b"".join(bytes(v) for v in p.views), record_views(p.views)) for p in full.payloads
        }
    assert (cache.misses, cache.hits, cache.runs) == (1, 2, 0)
    assert cache.gathered == 2 * 4  # per reused plan: every pack but the one of mixed dtypes
    assert [files[f"batched/0-{n}"][2] for n in range(5)] == [1, 1, 1, 3, 1]  # the mixed one: a view a tensor


def test_a_pack_buffer_is_filled_in_and_out_of_inference_mode_from_parameters_and_several_dtypes():
    """The buffer made inside torch.inference_mode() (a hook run during evaluation) is a normal
    tensor that later gathers outside it fill, and the other way round; parameters (which need
    grad) are copied without autograd; a pack of two dtypes is two runs."""
    buffer = writer.PackBuffer()
    for inference in (True, False, True, False):
        with torch.inference_mode(inference):
            tensors = [torch.nn.Parameter(torch.randn(6)), *(torch.randn(2, 3) for _ in range(6))]
            tensors.append(torch.arange(4, dtype=torch.int64))
            bounds = [0, 24, 48, 72, 96, 120, 144, 168, 200]
            segments = plan_cache._segments(tensors, bounds)
            assert segments == [(0, 7, torch.float32, False), (7, 8, torch.int64, True)]
            got = buffer.gather(tensors, segments, bounds)
        assert bytes(got) == b"".join(t.detach().numpy().tobytes() for t in tensors)
    assert plan_cache._segments(tensors[6:] * 4, [0, 24, 56, 80, 112, 136, 168, 192, 224]) is None  # a run a tensor
    odd = [torch.arange(3, dtype=torch.int8), *(torch.ones(2) for _ in range(7))]  # float32 from byte 3
    assert plan_cache._segments(odd, [0, 3, 11, 19, 27, 35, 43, 51, 59]) is None  # not viewable in place


def test_byte_runs_never_spans_two_storages_that_merely_touch():
    memory = bytearray(torch.arange(20, dtype=torch.float32).numpy().tobytes())
    left = torch.frombuffer(memory, dtype=torch.float32, count=10)
    right = torch.frombuffer(memory, dtype=torch.float32, count=10, offset=40)  # another storage, end to end
    assert left.data_ptr() + 40 == right.data_ptr()
    views = writer.byte_runs([left, right], np.array([40, 40]))
    assert len(views) == 2 and b"".join(bytes(v) for v in views) == bytes(memory)
    one = torch.arange(20, dtype=torch.float32)  # one storage: one view
    views = writer.byte_runs([one[:10], one[10:]], np.array([40, 40]))
    assert len(views) == 1 and bytes(views[0]) == one.numpy().tobytes()


def test_unsupported_dtype_is_a_config_error_naming_the_path():
    with pytest.raises(ConfigError, match="m/f8.*float8"):
        plan_for({"m": {"f8": torch.zeros(2, dtype=torch.float8_e4m3fn)}})


# --- flatten: exactly torchsnapshot's paths ---------------------------------------------------

TRICKY = {
    "a/b": torch.ones(1),
    "100%": {"x/y%z": 2, "%2F": "literal"},
    3: [4, {5: "five", "s": [OrderedDict([("k", 1), ("j", OrderedDict(q=[]))])]}],
    True: "bool key",
    "non_str_keys": {(1, 2): 3, "a": 1},
    "collide": {1: "int", "1": "str"},
    "tuple": (1, [2]),
    "empty": {},
    "empty_list": [],
    "..": {".": 1, "": 2},
}


@pytest.mark.parametrize("key", ["plain", "with/slash%", ".."])
def test_flatten_matches_torchsnapshots_flatten(key):
    containers, leaves = writer.flatten(key, TRICKY)
    stock_containers, stock_leaves = stock_flatten(TRICKY, prefix=key)
    assert containers == {path: asdict(entry) for path, entry in stock_containers.items()}
    assert list(containers) == list(stock_containers)
    assert list(leaves) == list(stock_leaves)
    assert all(leaves[path] is stock_leaves[path] for path in leaves)


def test_flatten_of_a_non_container_is_one_leaf():
    assert writer.flatten("k/1", (1, 2)) == ({}, {"k%2F1": (1, 2)})


# --- locations --------------------------------------------------------------------------------


def test_locations_stay_inside_the_snapshot_and_never_collide():
    values = ["..", ".", "", "../../etc", "a\x00b", "x" * 300, "é" * 200, "%2E", "%", "%2E%2E"]
    state = {name: torch.full((100,), float(i)) for i, name in enumerate(values)}
    state["objects"] = {name: (name,) for name in values}
    plan = plan_for({"..": state}, pack_bytes=0)
    rels = [payload.rel for payload in plan.payloads]
    assert len(rels) == 2 * len(values) and len(set(rels)) == len(rels)
    for rel in rels:
        parts = rel.split("/")
        assert parts[0] == "0" and posixpath.normpath(rel) == rel, rel
        assert all(part not in ("", ".", "..") and "\x00" not in part and len(part.encode()) <= 255 for part in parts)


def test_replicated_values_are_written_once_spread_over_ranks():
    leaves = {f"m/p{i}": torch.zeros(10 * (i + 1)) for i in range(6)}
    leaves["m/step"] = 5
    leaves["m/own"] = torch.ones(1)
    replicated = set(leaves) - {"m/own"}
    plans = [writer.plan({}, leaves, rank=r, world_size=2, replicated=replicated) for r in range(2)]
    for path in replicated:
        writers = [r for r in range(2) if f"0/{path}" in plans[r].entries]
        assert len(writers) == 1 and f"1/{path}" not in plans[1].entries, path
        assert json.loads(plans[writers[0]].entries[f"0/{path}"])["replicated"] is True
    assert "0/m/own" in plans[0].entries and "1/m/own" in plans[1].entries
    assert abs(plans[0].nbytes - plans[1].nbytes) <= 4 * 60 + 4  # greedy: within the largest item
    manifest = writer.merge([p.entries for p in plans])
    assert sum(path.startswith("0/") for path in manifest) == len(replicated) + 1


def test_replicable_matches_globs_and_leaves_sharded_values_out():
    leaves = {"m/w": torch.ones(1), "m/b": 1, "opt/state/0/x": 2, "other": 3}
    assert writer.replicable(leaves, ["m/*", "opt/**"]) == ["m/w", "m/b", "opt/state/0/x"]
    assert writer.replicable(leaves, []) == []


def test_merge_refuses_two_ranks_recording_one_path_differently():
    with pytest.raises(SnapshotError, match="0/m/x"):
        writer.merge([{"0/m/x": '{"type": "int", "serialized_value": "1"}'}, {"0/m/x": '{"type": "int", "serialized_value": "2"}'}])


def test_metadata_of_a_manifest_longer_than_a_chunk_reads_back_as_json_and_as_torchsnapshots_yaml():
    """.snapshot_metadata is built a chunk of records at a time: the chunks join into one
    document, and YAML-hostile characters are escaped in whichever chunk they fall."""
    import yaml

    count = 3 * merging.METADATA_CHUNK + 5
    manifest = {
        f"0/m/{'é😀' if i % 700 == 3 else ''}{chr(0x2028) if i == count - 1 else ''}x{i}": writer._text(
            {"type": "str", "serialized_value": "\x85 😀" if i == merging.METADATA_CHUNK else str(i), "replicated": False}
        )
        for i in range(count)
    }
    data = writer.metadata_bytes(manifest, 2)
    want = {"version": FORMAT_VERSION, "world_size": 2, "manifest": {p: json.loads(r) for p, r in manifest.items()}}
    assert json.loads(bytes(data)) == want
    assert yaml.load(bytes(data), Loader=yaml.CSafeLoader) == want  # as stock torchsnapshot reads it
    assert list(json.loads(bytes(data))["manifest"]) == list(manifest)  # in order


# --- two gloo ranks: replicated values, DTensor, ShardedTensor --------------------------------


def launch(script: str, args: list[str], out: Path, name: str) -> list[dict[str, Any]]:
    """Run ``script`` as 2 ranks (args + RANK 2 RENDEZVOUS), each recording to ``out/NAME{RANK}.json``."""
    return launching.run_ranks(
        lambda rank: [str(HERE / script), *args, str(rank), "2", str(out / f"{name}.rendezvous")],
        2,
        lambda rank: out / f"{name}{rank}.log",
        lambda rank: out / f"{name}{rank}.json",
        script,
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("two_ranks")
    writers = launch("format_writer_worker.py", [str(out / "snap"), str(out)], out, "writer")
    stocks = launch("stock_reader.py", ["dist", str(out / "snap"), str(out)], out, "stock")
    return out, writers, stocks


@pytest.mark.slow
def test_stock_torchsnapshot_restores_two_ranks_bitwise(two_ranks):
    _, _, stocks = two_ranks
    for record in stocks:
        assert "shard/dt_one" in record["compared"] and "shard/st_one" in record["compared"]
        assert record["mismatches"] == []


def _yaml_manifest(snapshot: Path) -> dict[str, Any]:
    """The manifest as torchsnapshot's loader reads it (YAML: the mesh names resolved)."""
    import yaml

    return yaml.load((snapshot / METADATA_FNAME).read_bytes(), Loader=yaml.CSafeLoader)["manifest"]


@pytest.mark.slow
def test_each_rank_writes_each_mesh_once_and_names_it_after(two_ranks):
    """Each rank's DTensor records on one mesh: the first holds it (a YAML anchor), the next name
    it. The plugin's reader and torchsnapshot's YAML loader read the same manifest."""
    import yaml

    out, _, _ = two_ranks
    data = (out / "snap" / METADATA_FNAME).read_bytes()
    assert data.count(b'"mesh": &m1_0 [0, 1]') == 1 and data.count(b'"mesh": *m1_0') == 2  # dt_one, dt_more
    assert data.count(b'"mesh": &m0_0 [0, 1]') == 1 and data.count(b'"mesh": *m0_0') == 2  # rank 0 alike
    ours = mesh_aliases.loads(data)
    assert ours == yaml.load(data, Loader=yaml.CSafeLoader)
    manifest = ours["manifest"]
    assert manifest["1/shard/dt_more"]["mesh"] == manifest["0/shard/dt_more"]["mesh"] == [0, 1]


@pytest.mark.slow
def test_two_ranks_record_replicated_values_once_under_rank0(two_ranks):
    out, writers, _ = two_ranks
    manifest = _yaml_manifest(out / "snap")
    for path in REPLICATED:
        assert f"0/{path}" in manifest and f"1/{path}" not in manifest, path
        assert sum(f"0/{path}" in record["snap"]["entries"] for record in writers) == 1, path
    assert {f"{rank}/model/b" for rank in range(2)} <= manifest.keys()
    payloads = [rel for record in writers for rel in record["snap"]["payloads"]]
    assert len(payloads) == len(set(payloads))  # no file written twice
    on_disk = {str(p.relative_to(out / "snap")) for p in (out / "snap").rglob("*") if p.is_file()}
    assert on_disk == set(payloads) | {METADATA_FNAME}
    assert all(rel.startswith(("0/", "batched/0-")) for rel in writers[0]["snap"]["payloads"])
    assert all(rel.startswith(("1/", "batched/1-")) for rel in writers[1]["snap"]["payloads"])


@pytest.mark.slow
def test_two_ranks_shard_records(two_ranks):
    out, _, _ = two_ranks
    manifest = _yaml_manifest(out / "snap")
    # a shard held by both ranks (Shard over a 1-rank mesh dim): one file, both records point at it
    part = [manifest[f"{rank}/shard/dt_part"] for rank in range(2)]
    assert part[0]["shards"][0]["tensor"]["location"] == part[1]["shards"][0]["tensor"]["location"]
    assert part[0]["mesh"] == [[0, 1]] and part[0]["dim_map"] == [[0], [-1]]
    assert manifest["1/shard/dt_one"]["shards"][0]["sizes"] == [0]
    assert manifest["0/shard/dt"]["dim_map"] == [[0]] and manifest["0/shard/dt"]["mesh"] == [0, 1]
    # a fully replicated DTensor: one record, under rank 0, its bytes written once
    rep_manifest = _yaml_manifest(out / "snap_rep")
    assert "1/rep/dt_rep" not in rep_manifest
    tensor = rep_manifest["0/rep/dt_rep"]["shards"][0]["tensor"]
    data = (out / "snap_rep" / tensor["location"]).read_bytes()
    start, end = tensor["byte_range"] or (0, len(data))
    restored = torch.frombuffer(bytearray(data[start:end]), dtype=torch.int32)
    assert torch.equal(restored, torch.arange(4, dtype=torch.int32))
