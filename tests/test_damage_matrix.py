"""Verify means restore: every kind of damage to a committed snapshot, met by `tnt-snapshot ls`,
`tnt-snapshot verify` and restore_from_latest, which must agree on which snapshot restores.

Two snapshots are written by a real torchtnt run (epoch_0_step_2, epoch_0_step_4), in each on-disk
format (torchsnapshot's, DCP's). Each file kind of the newest one (metadata, index, writer marker,
a pack of small tensors, a tensor file of its own, an object) is flipped, truncated, deleted or
swapped with the older snapshot's, and each field of its index is edited. In every case restore
either restores the newest snapshot exactly (the damage touched nothing restore reads), or falls
back to the older one with a warning naming the newest; ls marks, and verify reports, that same
snapshot.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from click.testing import CliRunner
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from toy import Holder, StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights

OLD, NEW = "epoch_0_step_2", "epoch_0_step_4"
METADATA, INDEX, MARKER = ".snapshot_metadata", ".tnt_snapshot_index.json", ".tnt_writer.json"
DCP_METADATA = ".metadata"


@pytest.fixture(scope="module", params=["torchsnapshot", "dcp"])
def written(tmp_path_factory, request) -> tuple[Path, dict[str, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("damage") / "run"
    seed_everything(5)
    unit = ToyUnit()
    unit.extra = Holder({"big": torch.randn(1_100_000), "opaque": (1, "two")})  # own file; an object
    expected: dict[str, dict[str, torch.Tensor]] = {}

    class Capture(TorchSnapshotSaver):
        def on_train_step_end(self, state, unit):
            super().on_train_step_end(state, unit)
            step = unit.train_progress.num_steps_completed
            expected[f"epoch_0_step_{step}"] = {**weights(unit), "big": unit.extra.state["big"].clone()}

    saver = Capture(
        str(root), save_every_n_train_steps=2, async_checkpoint=False, save_on_train_end=False, format=request.param
    )
    train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [OLD, NEW]
    return root, expected


def files_of(snapshot: Path) -> dict[str, Path]:
    """One file of each kind in a snapshot."""
    if (snapshot / DCP_METADATA).exists():
        return dcp_files_of(snapshot)
    index = json.loads((snapshot / INDEX).read_text())
    payloads = [snapshot / rel for rel in index["files"]]
    metadata = json.loads((snapshot / METADATA).read_text())["manifest"]
    [obj] = [e["location"] for p, e in metadata.items() if e["type"] == "object" and "opaque" in p]
    [big] = [e["location"] for p, e in metadata.items() if p.endswith("/extra/big")]
    packs = [p for p in payloads if "batched" in str(p)]
    assert packs and big and obj
    return {
        "metadata": snapshot / METADATA,
        "index": snapshot / INDEX,
        "writer marker": snapshot / MARKER,
        "pack": packs[0],
        "own file": snapshot / big,
        "object": snapshot / obj,
    }


def dcp_files_of(snapshot: Path) -> dict[str, Path]:
    """One file of each kind in a snapshot in DCP's format: its object and small tensors lie in
    files of packed records, the large tensor in a file of its own."""
    meta = pickle.loads((snapshot / DCP_METADATA).read_bytes())  # the test's own snapshot
    where = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
    own, obj = where["app_state.extra.big"], where["app_state.extra.opaque"]
    packs = sorted({where["app_state.model.0.weight"], obj})
    assert own not in packs
    return {
        "metadata": snapshot / DCP_METADATA,
        "index": snapshot / INDEX,
        "writer marker": snapshot / MARKER,
        "pack": snapshot / packs[0],
        "own file": snapshot / own,
        "object": snapshot / obj,
    }


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def swap(path: Path) -> None:
    """Its contents replaced by the same file of the older snapshot."""
    other = Path(str(path).replace(f"/{NEW}/", f"/{OLD}/"))
    shutil.copyfile(other, path)


HOW: dict[str, Callable[[Path], None]] = {"flipped": flip, "truncated": truncate, "deleted": os.remove, "swapped": swap}


def edit_index(field: str, change: Callable[[object], object]) -> Callable[[Path], None]:
    def edit(snapshot: Path) -> None:
        index = json.loads((snapshot / INDEX).read_text())
        index[field] = change(index.get(field))
        (snapshot / INDEX).write_text(json.dumps(index, sort_keys=True))

    return edit


def first_file(change: Callable[[object], object]) -> Callable[[object], object]:
    def on(mapping: object) -> object:
        assert isinstance(mapping, dict)
        key = sorted(k for k in mapping if k not in (METADATA, DCP_METADATA))[0]
        return {**mapping, key: change(mapping[key])}

    return on


def flipped_hex(text: str) -> str:
    return ("1" if text[0] != "1" else "2") + text[1:]


INDEX_EDITS: dict[str, Callable[[Path], None]] = {
    "seq": edit_index("seq", lambda seq: 0),
    "seq much higher": edit_index("seq", lambda seq: 10**6),
    "committed_at": edit_index("committed_at", lambda t: 0.0),
    "epoch": edit_index("epoch", lambda e: 9),
    "a file's size": edit_index("files", first_file(lambda size: size + 1)),
    "a whole-file checksum": edit_index("checksums", first_file(lambda r: {**r, "value": flipped_hex(r["value"])})),
    "a packed tensor's digest": edit_index(
        "checksums",
        lambda records: {
            k: ({**r, "digests": flipped_hex(r["digests"])} if "digests" in r else r) for k, r in records.items()
        },
    ),
    "writer": edit_index("writer", lambda w: {**w, "pid": 1}),
    "world_size": edit_index("world_size", lambda n: 2),
    "metric added": edit_index("metric", lambda m: {"name": "loss", "value": 0.1}),
    "emptied to {}": lambda s: (s / INDEX).write_text("{}"),
    "not JSON": lambda s: (s / INDEX).write_bytes(b"\x00{not json"),
    "seal removed (an index of an older version)": lambda s: (s / INDEX).write_text(
        json.dumps({k: v for k, v in json.loads((s / INDEX).read_text()).items() if k != "seal"})
    ),
}

CASES = [(f"{kind} {how}", kind, how) for kind in ("metadata", "index", "writer marker", "pack", "own file", "object") for how in HOW]
CASES += [(f"index field: {edit}", None, edit) for edit in INDEX_EDITS]


def run_cli(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert result.stderr == "", result.stderr
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("case,kind,how", CASES, ids=[c[0] for c in CASES])
def test_ls_verify_and_restore_agree_on_every_damage(written, tmp_path, case, kind, how):
    source, expected = written
    run = tmp_path / "run"
    shutil.copytree(source, run)
    newest = run / NEW
    if kind is None:
        INDEX_EDITS[how](newest)
    else:
        HOW[how](files_of(newest)[kind])

    code, listing = run_cli("ls", str(run))
    assert code == 0
    ls_pick = listing["restore"]
    code, verdict = run_cli("verify", str(run))
    verify_pick = verdict["restore"]
    newest_status = next((s["status"] for s in verdict["snapshots"] if s["name"] == NEW), None)
    assert (code == 1) == (newest_status == "damaged")

    fresh = ToyUnit(seed=99)
    fresh.extra = Holder({"big": torch.zeros(1_100_000), "opaque": None})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert TorchSnapshotSaver.restore_from_latest(str(run), fresh)
    restored = f"epoch_0_step_{fresh.train_progress.num_steps_completed}"
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "snapshot" in str(w.message)]

    assert ls_pick == verify_pick == restored, (case, ls_pick, verify_pick, restored, messages)
    assert_bitwise_equal({**weights(fresh), "big": fresh.extra.state["big"]}, expected[restored])
    assert fresh.extra.state["opaque"] == (1, "two")
    if restored == NEW:
        assert newest_status == "complete" and not messages, (case, messages)
    else:
        assert restored == OLD
        assert any(NEW in m for m in messages), (case, messages)
