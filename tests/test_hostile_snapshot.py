"""Hostile snapshots: a snapshot is trusted input, as a pickle is, but a damaged or crafted one
must still never make restore or the CLI open a file outside the snapshot, run code, print a
traceback, or drive the terminal.

Each case crafts the newest of two snapshots written by a real torchtnt run, as an attacker
would (the metadata edited, its checksum and the index's seal written again), and runs it through
restore_from_latest, restore by path, and every CLI command. The cases that do not edit
torchsnapshot's metadata run for DCP's format too. A DCP ``.metadata`` that is a hostile pickle
(one that would run code, one naming a class outside DCP's) is refused by restore and by every
command, naming what it names, with nothing run. Files outside the snapshot are FIFOs: opening one
for reading would release a writer thread, which the test then sees."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from click.testing import CliRunner
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    SnapshotCorruptError,
    SnapshotNotFoundError,
    StateMismatchError,
    UnrestorableStateError,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.format.checksums import record_views
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.format.torchsnapshot import manifest
from toy import Holder, StatefulLoader, ToyUnit, make_data

OLD, NEW = "epoch_0_step_2", "epoch_0_step_4"
METADATA, INDEX = ".snapshot_metadata", ".tnt_snapshot_index.json"
DCP_METADATA = ".metadata"
ESCAPE = "\x1b]0;owned\x07\x1b[2J"


@pytest.fixture(scope="module")
def writes(tmp_path_factory) -> Callable[[str], Path]:
    """``writes(format)``: the directory of two snapshots of a real torchtnt run in that format
    (each written once per module)."""
    made: dict[str, Path] = {}

    def write(fmt: str) -> Path:
        if fmt not in made:
            root = made[fmt] = tmp_path_factory.mktemp(f"hostile_{fmt}") / "run"
            unit = ToyUnit()
            unit.extra = Holder({"w": torch.arange(16.0), "obj": (1, "two")})
            saver = TorchSnapshotSaver(
                str(root), save_every_n_train_steps=2, async_checkpoint=False, save_on_train_end=False, format=fmt
            )
            train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])
        return made[fmt]

    return write


class Fifo:
    """A FIFO outside the snapshot; ``opened`` tells whether anyone opened it for reading."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        self._opened = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        fd = os.open(self.path, os.O_WRONLY)  # returns once a reader opens it
        if not self._closing:
            self._opened.set()
        os.close(fd)

    def opened(self) -> bool:
        was = self._opened.is_set()
        self._closing = True
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # releases the writer thread
        self._thread.join(5)
        os.close(fd)
        return was or self._opened.is_set()


def _write_metadata(snapshot: Path, doc: Any, raw: bytes | None = None) -> None:
    data = raw if raw is not None else json.dumps(doc).encode()
    (snapshot / METADATA).write_bytes(data)
    _reseal(snapshot, {METADATA: data})


def _reseal(snapshot: Path, changed: dict[str, bytes]) -> None:
    """The index made to agree with ``changed`` files (their sizes and checksums), sealed again."""
    index = json.loads((snapshot / INDEX).read_text())
    index.pop("seal", None)
    for rel, data in changed.items():
        index["checksums"][rel] = record_views([memoryview(data)])
        if rel not in (METADATA, DCP_METADATA):
            index["files"][rel] = len(data)
    (snapshot / INDEX).write_bytes(seal_index(index))


def _object_file(snapshot: Path) -> Path:
    """The file holding the ``extra/obj`` entry, in either format."""
    if (snapshot / DCP_METADATA).exists():
        meta = pickle.loads((snapshot / DCP_METADATA).read_bytes())  # the test's own snapshot
        [rel] = [info.relative_path for index, info in meta.storage_data.items() if index.fqn == "app_state.extra.obj"]
        return snapshot / rel
    doc = json.loads((snapshot / METADATA).read_text())
    [entry] = [e for p, e in doc["manifest"].items() if p.endswith("/extra/obj")]
    return snapshot / entry["location"]


def _edit_entry(snapshot: Path, suffix: str, **fields: Any) -> None:
    doc = json.loads((snapshot / METADATA).read_text())
    [path] = [p for p in doc["manifest"] if p.endswith(suffix)]
    doc["manifest"][path].update(fields)
    _write_metadata(snapshot, doc)


class _Planted:
    """Unpickling this creates a directory: proof that code from a snapshot ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant_pickle(snapshot: Path, tmp: Path) -> None:
    buffer = io.BytesIO()
    torch.save(_Planted(str(tmp / "marker")), buffer)  # as torch.save writes objects
    data = buffer.getvalue()
    if (snapshot / DCP_METADATA).exists():  # a file of its own, and the metadata pointing at it
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        rel = "0/__0_99.distcp"
        (snapshot / rel).write_bytes(data)
        meta = pickle.loads((snapshot / DCP_METADATA).read_bytes())
        for index in meta.storage_data:
            if index.fqn == "app_state.extra.obj":
                meta.storage_data[index] = _StorageInfo(rel, 0, len(data))
        (snapshot / DCP_METADATA).write_bytes(pickle.dumps(meta))
        _reseal(snapshot, {rel: data, DCP_METADATA: (snapshot / DCP_METADATA).read_bytes()})
        return
    doc = json.loads((snapshot / METADATA).read_text())
    [entry] = [e for p, e in doc["manifest"].items() if e["type"] == "object" and "/extra/obj" in p]
    (snapshot / entry["location"]).write_bytes(data)
    _reseal(snapshot, {entry["location"]: data})


def deep_nesting(snapshot: Path, tmp: Path) -> None:
    depth = 200_000
    raw = b'{"version": "0.1.0", "world_size": 1, "manifest": {"0/x": ' + b"[" * depth + b"]" * depth + b"}}"
    _write_metadata(snapshot, None, raw)


def control_characters(snapshot: Path, tmp: Path) -> None:
    doc = json.loads((snapshot / METADATA).read_text())
    doc["manifest"][f"0/extra/{ESCAPE}"] = {"type": "str", "serialized_value": ESCAPE, "replicated": False}
    doc["manifest"]["0/extra"]["keys"].append(ESCAPE)
    _write_metadata(snapshot, doc)


def deep_path(snapshot: Path, tmp: Path) -> None:
    doc = json.loads((snapshot / METADATA).read_text())
    doc["manifest"]["0/" + "/".join(["a"] * (manifest.MAX_PATH_DEPTH + 5))] = {
        "type": "int", "serialized_value": "1", "replicated": False
    }
    _write_metadata(snapshot, doc)


def symlinked_payload(snapshot: Path, tmp: Path) -> None:
    target = _object_file(snapshot)
    target.unlink()
    target.symlink_to(tmp / "outside")


def fifo_payload(snapshot: Path, tmp: Path) -> None:
    """A payload replaced by a FIFO inside the snapshot: opening it to read would block forever."""
    target = _object_file(snapshot)
    target.unlink()
    os.mkfifo(target)


def symlinked_metadata(snapshot: Path, tmp: Path) -> None:
    metadata = snapshot / (DCP_METADATA if (snapshot / DCP_METADATA).exists() else METADATA)
    metadata.unlink()
    metadata.symlink_to(tmp / "outside")


def symlinked_index(snapshot: Path, tmp: Path) -> None:
    (snapshot / INDEX).unlink()
    (snapshot / INDEX).symlink_to(tmp / "outside")


CASES: dict[str, Callable[[Path, Path], None]] = {
    "location ../ traversal": lambda s, t: _edit_entry(s, "/extra/obj", location=f"../../{t.name}/outside"),
    "location absolute": lambda s, t: _edit_entry(s, "/extra/obj", location=str(t / "outside")),
    "location with a backslash": lambda s, t: _edit_entry(s, "/extra/obj", location="0\\..\\..\\outside"),
    "payload is a symlink out": symlinked_payload,
    "payload is a FIFO": fifo_payload,
    "metadata is a symlink out": symlinked_metadata,
    "index is a symlink out": symlinked_index,
    "dtype lie (int32 for float32)": lambda s, t: _edit_entry(s, "/extra/w", dtype="torch.int32"),
    "shape lie (more elements than bytes)": lambda s, t: _edit_entry(s, "/extra/w", shape=[4, 8]),
    "unknown dtype": lambda s, t: _edit_entry(s, "/extra/w", dtype="torch.float8_e4m3fn"),
    "nesting 200,000 deep": deep_nesting,
    "a path deeper than the bound": deep_path,
    "control characters in a key and a value": control_characters,
    "planted pickle": plant_pickle,
}


#: cases whose snapshot is refused as a whole by a typed error other than damage
RAISES: dict[str, type[Exception]] = {
    "dtype lie (int32 for float32)": StateMismatchError,
    "planted pickle": UnrestorableStateError,
}
#: cases that restore: nothing in them is harmful
HARMLESS = {"control characters in a key and a value"}


#: the cases that do not edit torchsnapshot's metadata, run for DCP's format too
FORMAT_NEUTRAL = (
    "payload is a symlink out", "payload is a FIFO", "metadata is a symlink out", "index is a symlink out",
    "planted pickle",
)
PARAMS = [("torchsnapshot", case) for case in CASES] + [("dcp", case) for case in FORMAT_NEUTRAL]


def cli_commands(run: Path, tmp: Path, fmt: str) -> list[list[str]]:
    """Every command, on the run or its newest snapshot (each convert to a new DST)."""
    return [
        ["ls", str(run)],
        ["ls", str(run / NEW)],
        ["verify", str(run)],
        ["verify", str(run / NEW)],
        ["prune", str(run), "--keep-last", "1", "--dry-run"],
        ["inspect", str(run / NEW)],
        ["diff", str(run / OLD), str(run / NEW)],
        ["export", str(run / NEW), str(tmp / "out.pt"), "--key", "extra", "--force"],
        ["convert", str(run / NEW), str(tmp / "to_dcp" / NEW), "--to", "dcp"],
        ["convert", str(run / NEW), str(tmp / "to_torchsnapshot" / NEW), "--to", "torchsnapshot"],
        ["convert", str(run / NEW), str(tmp / "weights.pt"), "--to", "torch", "--key", "extra"],
        ["convert", str(run / NEW), str(tmp / "weights"), "--to", "safetensors"],
    ]


@pytest.mark.parametrize("fmt,case", PARAMS, ids=[f"{fmt}-{case}" for fmt, case in PARAMS])
def test_a_hostile_snapshot_opens_nothing_outside_runs_nothing_and_prints_no_traceback(writes, tmp_path, fmt, case):
    run = tmp_path / "run"
    shutil.copytree(writes(fmt), run)
    fifo = Fifo(tmp_path / "outside")
    CASES[case](run / NEW, tmp_path)

    for args in cli_commands(run, tmp_path, fmt):
        result = CliRunner().invoke(cli, args, catch_exceptions=True)
        out = result.stdout + result.stderr
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, out, result.exception)
        assert result.exit_code in (0, 1, 2), (args, result.exit_code, out)
        assert "Traceback" not in out and "\x1b" not in out and "\x07" not in out, (args, out)
        if result.exit_code == 2:  # bad input: one line, naming what is wrong
            assert result.stderr.count("\n") == 1 and result.stderr.startswith("tnt-snapshot: error: "), (args, out)

    # restore_from_latest: falls back from the hostile snapshot with a warning naming it, or, for
    # a snapshot that is intact but does not fit the state (a dtype lie) or holds an object the
    # restricted unpickler refuses, raises that typed error; only the harmless key restores.
    fresh = ToyUnit(seed=3)
    fresh.extra = Holder({"w": torch.zeros(16), "obj": None})
    raised = RAISES.get(case)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if raised is not None:
            with pytest.raises(raised):
                TorchSnapshotSaver.restore_from_latest(str(run), fresh)
        else:
            assert TorchSnapshotSaver.restore_from_latest(str(run), fresh)
    skipped = [str(w.message) for w in caught if "skipping" in str(w.message) and NEW in str(w.message)]
    if raised is None and case not in HARMLESS:
        assert fresh.train_progress.num_steps_completed == 2 and skipped, (case, caught)
    elif case in HARMLESS:
        assert fresh.train_progress.num_steps_completed == 4 and not skipped
        assert fresh.extra.state[ESCAPE] == ESCAPE

    # restore by path: the same refusal, typed
    again = ToyUnit(seed=3)
    again.extra = Holder({"w": torch.zeros(16), "obj": None})
    if case in HARMLESS:
        TorchSnapshotSaver.restore(str(run / NEW), again)
        assert torch.equal(again.extra.state["w"], torch.arange(16.0))
    else:
        with pytest.raises(raised or (SnapshotCorruptError, SnapshotNotFoundError)):
            TorchSnapshotSaver.restore(str(run / NEW), again)

    assert not fifo.opened(), case
    assert not (tmp_path / "marker").exists(), case


def _metadata_with(snapshot: Path, planted: Any) -> bytes:
    """The snapshot's own ``.metadata`` with ``planted`` in one of its fields."""
    meta = pickle.loads((snapshot / DCP_METADATA).read_bytes())  # the test's own snapshot
    meta.storage_meta.save_id = planted
    return pickle.dumps(meta)


#: hostile .metadata pickles: (the bytes, from the snapshot and the marker's path; what they name)
HOSTILE_METADATA: dict[str, tuple[Callable[[Path, str], bytes], str]] = {
    "a pickle that would run code": (lambda s, marker: pickle.dumps(_Planted(marker)), "posix.mkdir"),
    "code planted inside DCP's metadata": (lambda s, marker: _metadata_with(s, _Planted(marker)), "posix.mkdir"),
    "a class outside DCP's": (lambda s, marker: _metadata_with(s, __import__("datetime").date(2026, 1, 1)), "datetime.date"),
}


@pytest.mark.parametrize("case", list(HOSTILE_METADATA))
def test_a_hostile_dcp_metadata_is_refused_by_restore_and_every_command_and_nothing_runs(writes, tmp_path, case):
    run = tmp_path / "run"
    shutil.copytree(writes("dcp"), run)
    make, named = HOSTILE_METADATA[case]
    marker = tmp_path / "marker"
    data = make(run / NEW, str(marker))
    (run / NEW / DCP_METADATA).write_bytes(data)
    _reseal(run / NEW, {DCP_METADATA: data})
    refusal = f".metadata names {named}, which is not one of DCP's metadata classes: it was refused unread"

    for args in cli_commands(run, tmp_path, "dcp"):
        result = CliRunner().invoke(cli, args, catch_exceptions=True)
        out = result.stdout + result.stderr
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, out, result.exception)
        assert "Traceback" not in out and refusal in out, (args, out)
        if args[0] in ("ls", "prune") and args[1] == str(run):  # a listing: the row is damaged, the line names it
            assert result.exit_code == 0 and f"{NEW}: {refusal}" in result.stdout, (args, out)
        elif args[0] == "verify":  # damage found
            assert result.exit_code == 1 and f"{NEW}: {refusal}" in result.stdout, (args, out)
        elif args[0] == "ls":  # one snapshot's files and its status
            assert result.exit_code == 0 and "damaged" in result.stdout, (args, out)
        else:  # a damaged snapshot named by path: bad input, one line
            assert result.exit_code == 2 and result.stdout == "", (args, out)
            assert result.stderr.count("\n") == 1 and result.stderr.startswith("tnt-snapshot: error: "), (args, out)
    assert not any(p.exists() for p in (tmp_path / "to_dcp", tmp_path / "to_torchsnapshot", tmp_path / "weights.pt",
                                        tmp_path / "weights", tmp_path / "out.pt"))

    fresh = ToyUnit(seed=3)
    fresh.extra = Holder({"w": torch.zeros(16), "obj": None})
    with pytest.raises(SnapshotCorruptError, match=named.replace(".", r"\.")):
        TorchSnapshotSaver.restore(str(run / NEW), fresh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert TorchSnapshotSaver.restore_from_latest(str(run), fresh)
    assert fresh.train_progress.num_steps_completed == 2
    assert any(named in str(w.message) and NEW in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert not marker.exists()


def test_the_fifo_detector_sees_a_read_open(tmp_path):
    fifo = Fifo(tmp_path / "outside")
    fd = os.open(fifo.path, os.O_RDONLY | os.O_NONBLOCK)
    fifo._thread.join(5)
    os.close(fd)
    assert fifo.opened()
    assert not Fifo(tmp_path / "untouched").opened()
