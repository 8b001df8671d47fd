"""format/reader.py against snapshots written by STOCK torchsnapshot (tests/format_reader_worker.py,
in processes that never import the plugin): every entry kind read back bitwise, resharding over
2 gloo ranks, and damage (flipped bytes under a checksum verifier, truncated and missing files,
locations outside the snapshot, malformed metadata) raising SnapshotCorruptError."""

from __future__ import annotations

import collections
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import launching
import numpy as np
import pytest
import torch

from tnt_snapshot_plugin.errors import SnapshotCorruptError, StateMismatchError
from tnt_snapshot_plugin.format import checksums
from tnt_snapshot_plugin.format.torchsnapshot.common import flat_bytes
from tnt_snapshot_plugin.format.torchsnapshot.reader import (
    Metadata,
    parse_metadata,
    rank_view,
    read_state_dict,
    read_value,
    saved_keys,
)

WORKER = Path(__file__).with_name("format_reader_worker.py")
KEYS = ("model", "other/key%")


class LocalFiles:
    """A small local-file ``read_into`` (one pread per read) that counts its calls."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.calls: list[int] = []

    def read_into(self, reads: list, done=None) -> None:  # no done(): the reader checks after
        self.calls.append(len(reads))
        for rel, offset, view in reads:
            path = self.root / rel
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError as exc:
                raise SnapshotCorruptError(f"{path} is missing") from exc
            try:
                got = 0
                while got < view.nbytes:
                    n = os.preadv(fd, [view[got:]], offset + got)
                    if n == 0:
                        raise SnapshotCorruptError(f"{path} ends at byte {offset + got}, before byte {offset + view.nbytes}")
                    got += n
            finally:
                os.close(fd)

    def file_size(self, rel: str) -> Optional[int]:
        try:
            return os.path.getsize(self.root / rel)
        except FileNotFoundError:
            return None


def _worker(*args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("dense")
    proc = _worker("dense", str(out / "snap"), str(out / "expected.pt"))
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log.decode()
    return out / "snap", torch.load(out / "expected.pt", weights_only=False)


@pytest.fixture
def snap(dense, tmp_path) -> Path:
    """A copy of the dense snapshot that a test may damage."""
    return Path(shutil.copytree(dense[0], tmp_path / "snap"))


def _meta(root: Path) -> Metadata:
    return parse_metadata((root / ".snapshot_metadata").read_bytes(), str(root))


def _read(root: Path, key: str, target: Any, **kw: Any) -> tuple[Any, LocalFiles]:
    files = LocalFiles(root)
    view = rank_view(_meta(root), 0)
    out = read_state_dict(view, key, target, files.read_into, file_size=files.file_size, **kw)
    return out, files


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Bitwise equality, types included (dict vs OrderedDict, -0.0 vs 0.0, dtypes, qparams)."""
    assert type(got) is type(want) or (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)), (where, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        if want.is_quantized:
            assert got.qscheme() == want.qscheme(), where
            if want.qscheme() == torch.per_tensor_affine:
                assert (got.q_scale(), got.q_zero_point()) == (want.q_scale(), want.q_zero_point()), where
            else:
                assert torch.equal(got.q_per_channel_scales(), want.q_per_channel_scales()), where
            got, want = got.int_repr(), want.int_repr()
        if want.is_complex():
            got, want = torch.view_as_real(got), torch.view_as_real(want)
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), where
    elif isinstance(want, np.ndarray):
        assert want.dtype == got.dtype and np.array_equal(got, want), where
    elif isinstance(want, float):
        assert struct.pack("d", got) == struct.pack("d", want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}/{i}")
    else:
        assert got == want, where


def _zeros_like(value: Any) -> Any:
    """A target shaped like ``value``: zeroed tensors (a non-contiguous one stays so)."""
    if isinstance(value, torch.Tensor) and not value.is_quantized:
        return torch.zeros(value.shape[::-1], dtype=value.dtype).t() if not value.is_contiguous() else torch.zeros_like(value)
    if isinstance(value, dict):
        return type(value)((k, _zeros_like(v)) for k, v in value.items())
    if type(value) is list:
        return [_zeros_like(v) for v in value]
    return value


def test_every_kind_reads_bitwise_into_the_targets_tensors(dense):
    root, expected = dense
    view = rank_view(_meta(root), 0)
    assert saved_keys(view) == set(KEYS)
    for key in KEYS:
        target = _zeros_like(expected[key])
        out, files = _read(root, key, target)
        assert_same(out, expected[key], key)
        assert len(files.calls) == 1  # every read of the key in one read_into call
    model = _zeros_like(expected["model"])
    out, _ = _read(root, "model", model)
    for name in ("f32", "bf16", "i8", "bool", "scalar", "big", "chunked", "chunked2d", "noncontig", "c64"):
        assert out[name] is model[name], name  # filled in place
    assert out["nested"]["list"][0] is model["nested"]["list"][0]
    assert not model["noncontig"].is_contiguous()
    assert_same(model["chunked2d"], expected["model"]["chunked2d"])


def test_without_target_tensors_every_kind_reads_into_new_tensors(dense):
    root, expected = dense
    out, files = _read(root, "model", {})
    assert_same(out, expected["model"])
    assert len(files.calls) == 1
    assert_same(read_value(rank_view(_meta(root), 0), "model/nested/od", files.read_into), expected["model"]["nested"]["od"])
    assert_same(read_value(rank_view(_meta(root), 0), "model/chunked", files.read_into), expected["model"]["chunked"])


def test_a_target_of_another_shape_gets_the_saved_value(dense):
    root, expected = dense
    target = {"f32": torch.zeros(2, 2), "chunked": torch.zeros(3)}
    out, _ = _read(root, "model", target)
    for name in target:
        assert out[name] is not target[name]
        assert_same(out[name], expected["model"][name])
        assert not target[name].any()


@pytest.mark.parametrize("name,dtype", [("i64", torch.int32), ("f32", torch.float64), ("chunked", torch.float16)])
def test_a_target_of_another_dtype_is_a_mismatch_never_a_cast(dense, name, dtype):
    root, expected = dense
    shape = expected["model"][name].shape
    target = {name: torch.zeros(shape, dtype=dtype)}
    with pytest.raises(StateMismatchError, match=rf"'model/{name}'.*holds a torch\.\w+ tensor.*{dtype}.*not cast"):
        _read(root, "model", target)
    assert not target[name].any()


def test_parameters_with_grad_are_filled_in_place(dense):
    root, expected = dense
    module = torch.nn.Linear(5, 3)
    target = {"f32": module.weight, "big": torch.nn.Parameter(torch.zeros(16384))}
    out, _ = _read(root, "model", target)
    assert out["f32"] is module.weight and module.weight.requires_grad
    assert torch.equal(module.weight.detach(), expected["model"]["f32"])
    assert torch.equal(target["big"].detach(), expected["model"]["big"])


def test_rank_view_of_a_rank_beyond_the_saving_world_gets_the_replicated_entries(dense):
    root, _ = dense
    view = rank_view(_meta(root), 3)
    leaves = {path for path, entry in view.items() if entry["type"] not in ("dict", "OrderedDict", "list")}
    assert leaves == {"other%2Fkey%25/t"}  # and rank 0's containers
    files = LocalFiles(root)
    assert torch.equal(read_state_dict(view, "other/key%", {}, files.read_into)["t"], torch.arange(3.0))


def _synthetic(tmp_path: Path, entries: dict[str, dict], files: dict[str, bytes]) -> Path:
    root = tmp_path / "synth"
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    manifest = {"0/k": {"type": "dict", "keys": [p.split("/", 2)[2] for p in entries]}, **entries}
    (root / ".snapshot_metadata").write_text(json.dumps({"version": "0.1.0", "world_size": 1, "manifest": manifest}))
    return root


def test_bfloat16_of_odd_length_and_yaml_metadata(tmp_path):
    """Stock torchsnapshot cannot write an odd-length bfloat16 (it loses the last element); the
    plugin's writer can, and the reader reads it. Older torchsnapshot wrote YAML metadata."""
    value = torch.randn(7).to(torch.bfloat16)
    data = flat_bytes(value).tobytes()
    entry = {"type": "Tensor", "location": "0/k/v", "serializer": "buffer_protocol", "dtype": "torch.bfloat16",
             "shape": [7], "replicated": False, "byte_range": None}
    root = _synthetic(tmp_path, {"0/k/v": entry}, {"0/k/v": data})
    out, _ = _read(root, "k", {"v": torch.zeros(7, dtype=torch.bfloat16)})
    assert_same(out["v"], value)
    yaml = pytest.importorskip("yaml")
    doc = json.loads((root / ".snapshot_metadata").read_text())
    text = yaml.safe_dump(doc).encode()
    with pytest.raises(ValueError):
        json.loads(text)
    assert parse_metadata(text, "x").manifest == doc["manifest"]


# --- damage -------------------------------------------------------------------------------------

def _entries(meta: Metadata) -> list[dict]:
    """Every tensor-or-object entry holding bytes, pieces of chunked and sharded ones included."""
    found = []
    for entry in meta.manifest.values():
        for piece in entry.get("chunks") or entry.get("shards") or ():
            found.append(piece["tensor"])
        if "location" in entry:
            found.append(entry)
    return found


def verifier_for(root: Path) -> checksums.Verifier:
    """Checksum records over the snapshot's files, as the plugin's index holds them (a packed
    file gets one range per tensor)."""
    ranges: dict[str, set] = collections.defaultdict(set)
    for entry in _entries(_meta(root)):
        if entry.get("byte_range"):
            ranges[entry["location"]].add(tuple(entry["byte_range"]))
    records, sizes = {}, {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() or rel == ".snapshot_metadata":
            continue
        data = memoryview(path.read_bytes())
        if rel in ranges:
            spans = sorted(ranges[rel])
            assert spans[0][0] == 0 and spans[-1][1] == len(data)
            records[rel] = checksums.record_views([memoryview(data)[a:b] for a, b in spans])
        else:
            records[rel] = checksums.record_views([memoryview(data)])
        sizes[rel] = len(data)
    return checksums.Verifier(str(root), records, sizes)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x20
    path.write_bytes(bytes(data))


def _location(root: Path, logical: str, chunk: Optional[int] = None) -> tuple[str, int, int]:
    entry = _meta(root).manifest[f"0/{logical}"]
    if chunk is not None:
        entry = entry["chunks"][chunk]["tensor"]
    rel = entry["location"]
    start, end = entry.get("byte_range") or (0, os.path.getsize(root / rel))
    return rel, start, end


@pytest.mark.parametrize(
    "logical,chunk",
    [("model/big", None), ("model/f32", None), ("model/chunked", 1), ("model/c64", None),
     ("model/q8", None), ("model/np", None), ("model/nested/od/3", None)],
    ids=["raw-file", "byte-range", "chunk", "torch-save-tensor", "quantized", "object", "nested"],
)
def test_a_flipped_byte_is_caught_by_the_verifier(snap, logical, chunk):
    verifier = verifier_for(snap)
    out, _ = _read(snap, "model", {}, verifier=verifier)  # intact: reads, and verifies bytes
    assert verifier.verified_bytes > 0
    rel, start, end = _location(snap, logical, chunk)
    _flip(snap / rel, (start + end) // 2)
    with pytest.raises(SnapshotCorruptError) as info:
        _read(snap, "model", _zeros_like(out), verifier=verifier)
    assert rel in str(info.value) and logical in str(info.value)


@pytest.mark.parametrize("logical", ["model/np", "model/c64"])
def test_an_undecodable_payload_names_its_file_and_entry(snap, logical):
    rel, _, end = _location(snap, logical)
    (snap / rel).write_bytes(b"not a pickle at all".ljust(end, b"!"))
    with pytest.raises(SnapshotCorruptError) as info:
        _read(snap, "model", {})
    assert rel in str(info.value) and logical in str(info.value)


def test_a_truncated_packed_file_names_the_file_and_an_entry(snap):
    rel, _, _ = _location(snap, "model/f32")
    path = snap / rel
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(SnapshotCorruptError) as info:
        _read(snap, "model", {})
    assert rel in str(info.value) and "entry 'model/" in str(info.value)


@pytest.mark.parametrize("logical", ["model/big", "model/np"])
def test_a_missing_file_names_the_file_and_the_entry(snap, logical):
    rel, _, _ = _location(snap, logical)
    (snap / rel).unlink()
    with pytest.raises(SnapshotCorruptError) as info:
        _read(snap, "model", {})
    assert rel in str(info.value) and logical in str(info.value)


def _edit(root: Path, logical: str, **fields: Any) -> None:
    doc = json.loads((root / ".snapshot_metadata").read_text())
    doc["manifest"][f"0/{logical}"].update(fields)
    (root / ".snapshot_metadata").write_text(json.dumps(doc))


@pytest.mark.parametrize("location", ["../outside", "/etc/passwd", "0/../../x", "0//x", ""])
@pytest.mark.parametrize("logical", ["model/big", "model/np"])
def test_a_location_outside_the_snapshot_is_refused_before_any_read(snap, location, logical):
    _edit(snap, logical, location=location)
    with pytest.raises(SnapshotCorruptError) as info:
        _, files = _read(snap, "model", {})
    assert logical in str(info.value) and "outside the snapshot" in str(info.value)


@pytest.mark.parametrize(
    "fields,says",
    [({"type": "Sparse"}, "unknown entry type"), ({"dtype": "torch.float8"}, "unknown dtype"),
     ({"byte_range": [0, 3]}, "byte range"), ({"serializer": "pickle5"}, "serializer"),
     ({"shape": [-1]}, "shape")],
)
def test_malformed_entries_are_corruption(snap, fields, says):
    _edit(snap, "model/f32", **fields)
    with pytest.raises(SnapshotCorruptError, match=says) as info:
        _read(snap, "model", {})
    assert "model/f32" in str(info.value)


@pytest.mark.parametrize(
    "field",
    [{"byte_range": [0, 3]}, {"byte_range": [-4, 0]}, {"byte_range": [0.0, 4.0]}, {"byte_range": "0-4"},
     {"byte_range": [0, 4, 8]}, {"location": ["batched"]}, {"location": None}],
    ids=["short", "negative", "floats", "text", "three", "location-list", "location-none"],
)
def test_a_malformed_entry_is_corruption_when_reading_straight_into_the_target(dense, snap, field):
    """The reader's hot path (a packed tensor read straight into a matching target, its file
    already checked for an earlier entry) still checks every entry: the damaged one is the
    second tensor of its file, so the hot path is where it is read."""
    want = dense[1]["model"]

    def direct(key: str) -> bool:  # a tensor the reader reads straight into a zeros_like target
        value = want.get(key)
        return type(value) is torch.Tensor and not value.is_quantized and value.is_contiguous() and value.numel() > 0

    ranged: dict[str, list[str]] = {}
    for path, entry in _meta(snap).manifest.items():
        key = path.removeprefix("0/model/")
        if path.startswith("0/model/") and entry["type"] == "Tensor" and entry.get("byte_range") and direct(key):
            ranged.setdefault(entry["location"], []).append(key)
    rel, keys = max(ranged.items(), key=lambda item: len(item[1]))
    assert len(keys) >= 2, ranged
    _edit(snap, f"model/{keys[-1]}", **field)
    target = {key: torch.zeros_like(want[key]) for key in keys}
    with pytest.raises(SnapshotCorruptError) as info:
        _read(snap, "model", target)
    assert f"model/{keys[-1]}" in str(info.value)


@pytest.mark.parametrize(
    "data",
    [b"\x00{not metadata", b"[1, 2]", b'{"version": "0", "world_size": 0, "manifest": {}}',
     b'{"version": "0", "world_size": 1, "manifest": {"1/k": {"type": "int"}}}',
     b'{"version": "0", "world_size": 1, "manifest": {"0/k": 3}}'],
)
def test_malformed_metadata_is_corruption(data):
    with pytest.raises(SnapshotCorruptError, match="where"):
        parse_metadata(data, "where")


# --- sharded entries over 2 ranks -------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sharded")
    records = launching.run_ranks(
        lambda rank: [str(WORKER), "sharded", str(out / "snap"), str(out), str(rank), "2", str(out / "rendezvous")],
        2,
        lambda rank: out / f"rank{rank}.log",
        lambda rank: out / f"rank{rank}.json",
        "the 2-rank snapshot",
    )
    return out / "snap", records


def test_two_ranks_read_under_another_sharding(sharded):
    _, records = sharded
    for rank, record in enumerate(records):
        assert record["calls"] and len(record["calls"]) == 1
        assert record["same_objects"]
        assert record["st_boxes"] == ([True] if rank == 0 else [True, True])
        assert record["dt"] and record["drep"] and record["rep"]
        assert record["dt_local_cols"] == [10, 3]
        assert record["mine"] == [float(rank)] * 3
        assert record["step"] == 11


def _sharded_globals() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(WORKER.parent))
    try:
        import format_reader_worker
    finally:
        sys.path.pop(0)
    return format_reader_worker.globals_()


def test_one_rank_reads_whole_tensors_from_sharded_entries(sharded):
    root, _ = sharded
    full = _sharded_globals()
    meta = _meta(root)
    files = LocalFiles(root)
    for rank in (0, 1, 2):  # 2: a rank the saving world did not have
        view = rank_view(meta, rank)
        target = {name: torch.zeros_like(full[name]) for name in ("st", "dt", "drep")}
        out = read_state_dict(view, "model", target, files.read_into)
        for name in target:
            assert out[name] is target[name] and torch.equal(target[name], full[name]), (rank, name)
        assert torch.equal(out["rep"], full["rep"]) and out["step"] == 11
        assert ("mine" in out) == (rank < 2)
        if rank < 2:
            assert out["mine"].tolist() == [float(rank)] * 3
        assert torch.equal(read_value(view, "model/st", files.read_into), full["st"])
    # a sharded entry the target does not ask for is left out, as torchsnapshot leaves it out
    assert "st" not in read_state_dict(rank_view(meta, 0), "model", {}, files.read_into)


def test_a_flipped_byte_in_a_shard_is_caught(sharded, tmp_path):
    root = Path(shutil.copytree(sharded[0], tmp_path / "snap"))
    verifier = verifier_for(root)
    shard = _meta(root).manifest["1/model/dt"]["shards"][0]["tensor"]
    start, end = shard.get("byte_range") or (0, os.path.getsize(root / shard["location"]))
    _flip(root / shard["location"], start + 3)
    files = LocalFiles(root)
    with pytest.raises(SnapshotCorruptError) as info:
        read_state_dict(rank_view(_meta(root), 0), "model", {"dt": torch.zeros(10, 6, dtype=torch.float64)},
                        files.read_into, verifier=verifier)
    assert shard["location"] in str(info.value) and "model/dt" in str(info.value)


def _raw_entry(location: str, value: torch.Tensor, start: int = 0) -> dict:
    nbytes = value.numel() * value.element_size()
    return {"type": "Tensor", "location": location, "serializer": "buffer_protocol", "dtype": str(value.dtype),
            "shape": list(value.shape), "replicated": False, "byte_range": [start, start + nbytes]}


def test_dtensor_replicas_are_merged_once_and_a_rank_reads_shards_it_did_not_save(tmp_path):
    """4 ranks on a 2x2 mesh, a DTensor sharded over mesh dim 0 and replicated over dim 1: ranks
    0 and 1 hold the same rows, as do 2 and 3. Rank 3 saved no 'w' (its dict does not list it)."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    top, bottom = flat_bytes(full[:3].contiguous()).tobytes(), flat_bytes(full[3:].contiguous()).tobytes()
    root = tmp_path / "snap"
    (root / "sharded").mkdir(parents=True)
    (root / "sharded/top").write_bytes(top)
    (root / "sharded/bottom").write_bytes(bottom)

    def dtensor(rows: int, location: str) -> dict:
        tensor = _raw_entry(location, full[rows:rows + 3])
        return {"type": "DTensor", "mesh": [[0, 1], [2, 3]], "dim_map": [[0], [-1]],
                "shards": [{"offsets": [rows, 0], "sizes": [3, 4], "tensor": tensor}]}

    manifest = {}
    for rank in range(4):
        manifest[f"{rank}/m"] = {"type": "dict", "keys": ["w"] if rank < 3 else []}
        if rank < 3:
            manifest[f"{rank}/m/w"] = dtensor(0 if rank < 2 else 3, "sharded/top" if rank < 2 else "sharded/bottom")
    meta = parse_metadata(json.dumps({"version": "0", "world_size": 4, "manifest": manifest}).encode(), str(root))
    files = LocalFiles(root)
    for rank in (0, 3, 5):
        view = rank_view(meta, rank)
        assert [s["offsets"] for s in view["m/w"]["shards"]] == [[0, 0], [3, 0]]
        target = {"w": torch.zeros(6, 4)}
        out = read_state_dict(view, "m", target, files.read_into)
        assert out["w"] is target["w"] and torch.equal(target["w"], full), rank
    assert sorted(files.calls) == [2, 2, 2]


def test_an_object_refused_by_weights_only_names_its_entry(tmp_path):
    import fractions
    import io

    from tnt_snapshot_plugin.errors import UnrestorableStateError

    buf = io.BytesIO()
    torch.save(fractions.Fraction(1, 3), buf)
    entry = {"type": "object", "location": "0/k/v", "serializer": "torch_save", "obj_type": "fractions.Fraction", "replicated": False}
    root = _synthetic(tmp_path, {"0/k/v": entry}, {"0/k/v": buf.getvalue()})
    with pytest.raises(UnrestorableStateError, match="'k/v'"):
        _read(root, "k", {})
    out, _ = _read(root, "k", {}, weights_only=False)
    assert out == {"v": fractions.Fraction(1, 3)}
