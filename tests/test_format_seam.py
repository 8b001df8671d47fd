"""A format of one's own, through the format seam (``format.base.Format``): the saver, retention,
latest selection, verify, the command line and restore work on it without knowing it.

The format here is tiny: one ``torch.save`` file per rank holding every entry's state dict, and a
JSON metadata file listing them. Everything else is the plugin's: staging and the commit, the
index with every file's size and checksum, retention after a commit, which snapshot is latest,
the fallback from a damaged one.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any, Callable, Optional

import pytest
import torch
from click.testing import CliRunner

from tnt_snapshot_plugin import SnapshotFallbackWarning, restore_from_latest
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.errors import StateMismatchError
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.base import Payload
from tnt_snapshot_plugin.format.registry import register_format, unregister_format
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.stores import LocalStore
from toy import Holder

METADATA = "state.meta.json"


class _Writer:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def encode(self, job: Any, sink: Any) -> tuple[Any, Optional[BaseException]]:
        buf = io.BytesIO()
        torch.save({key: frozen.state_dict() for key, frozen in job.frozen.items()}, buf)
        rel = f"{self.rank}/state.pt"
        sink.submit(Payload(rel, [memoryview(buf.getbuffer())]))
        return {"file": rel, "keys": sorted(job.frozen)}, None

    def outgoing(self, records: Any) -> Any:
        return records

    def metadata(self, gathered: list[Any]) -> tuple[bytes, dict[str, Any]]:
        return json.dumps({"ranks": gathered}).encode(), {}

    def aborted(self) -> None: ...

    def settled(self) -> None: ...

    def new_run(self) -> None: ...

    def close(self) -> None: ...


class _Reader:
    def __init__(self, files: Any, meta: dict[str, Any]) -> None:
        self.files = files
        self.world_size = len(meta["ranks"])
        self.entry = meta["ranks"][0]
        self._states: Optional[dict[str, Any]] = None

    def keys(self) -> set[str]:
        return set(self.entry["keys"])

    def fit_world_size(self, keys: set[str]) -> bool:
        raise StateMismatchError("this format restores on the world size it was saved on only")

    def check_modules(self, load: Any) -> dict[str, Any]:
        return {}

    def read(self, key: str, current: Any) -> Any:
        if self._states is None:
            self._states = torch.load(io.BytesIO(self.files.read_checked(self.entry["file"])), weights_only=True)
        return self._states[key]


class TorchSaveFormat:
    """One ``torch.save`` file a rank, and a JSON metadata file naming them."""

    name = "torchsave-test"
    metadata_file = METADATA

    def writer(self, collectives: Any, config: Any) -> _Writer:
        return _Writer(collectives.rank)

    def reads_by_rank(self, index: Any, ranks: int) -> bool:
        return False

    def check(self, files: Any, verdict: Any, *, size_of: Callable[[str], Optional[int]]) -> None:
        try:
            meta = json.loads(files.read_checked(METADATA))
        except Exception as exc:
            verdict.problems.append(f"{METADATA} cannot be read ({type(exc).__name__})")
            return
        for rank in meta["ranks"]:
            if size_of(rank["file"]) is None:
                verdict.problems.append(f"the metadata reads file {rank['file']}, but it is missing")
        verdict.metadata = meta

    def check_payloads(self, files: Any, verdict: Any) -> None:
        for rank in verdict.metadata["ranks"]:
            torch.load(io.BytesIO(files.store.read_file(files.name, rank["file"])), weights_only=True)

    def reader(self, files: Any, collectives: Any, verdict: Any, *, weights_only: bool) -> _Reader:
        if verdict is not None and verdict.metadata is not None:
            return _Reader(files, verdict.metadata)
        return _Reader(files, json.loads(files.read_checked(METADATA)))


@pytest.fixture
def fmt():
    tiny = TorchSaveFormat()
    register_format(tiny)
    yield tiny
    unregister_format(tiny.name)


def names(dirpath: Any) -> list[str]:
    return [s.text for s in listing.complete_snapshots(LocalStore(str(dirpath)))]


def test_a_format_of_ones_own_saves_commits_retains_verifies_and_restores(tmp_path, fmt):
    config = SnapshotConfig.build(format=fmt, keep_last_n_snapshots=2, async_snapshot=True, preemption_signals=[])
    saver = Snapshotter(str(tmp_path), config)
    weights = Holder({"w": torch.zeros(4), "b": torch.zeros(2)})
    saver.train_start(["model"], 0, 0)
    for step in range(1, 5):
        weights.state["w"] += step
        saver.save(0, step, {"model": weights})
    saver.train_end(0, 4, lambda intra_epoch: {"model": weights})

    # the plugin's commit, index and retention around the format's own files
    assert names(tmp_path) == ["epoch_0_step_3", "epoch_0_step_4"]
    newest = tmp_path / "epoch_0_step_4"
    assert sorted(os.listdir(newest)) == [".tnt_snapshot_index.json", ".tnt_writer.json", "0", METADATA]
    index = json.loads((newest / ".tnt_snapshot_index.json").read_text())
    assert index["snapshot_format"] == fmt.name and set(index["checksums"]) == {"0/state.pt", METADATA}
    verdict = verify.check(LocalStore(str(tmp_path)), "epoch_0_step_4", checksums=True)
    assert verdict.intact and verdict.format is fmt

    # restore_from_latest picks the newest, and restores exactly what was saved
    target = Holder({"w": torch.ones(4), "b": torch.ones(2)})
    assert restore_from_latest(str(tmp_path), {"model": target}) == str(newest)
    assert torch.equal(target.state["w"], torch.full((4,), 10.0)) and torch.equal(target.state["b"], torch.zeros(2))

    # a damaged newest snapshot (a byte of the format's payload changed) is skipped for the previous
    payload = newest / "0" / "state.pt"
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
    assert not verify.check(LocalStore(str(tmp_path)), "epoch_0_step_4", checksums=True).intact
    target = Holder({"w": torch.ones(4), "b": torch.ones(2)})
    with pytest.warns(SnapshotFallbackWarning, match="epoch_0_step_4"):
        assert restore_from_latest(str(tmp_path), {"model": target}) == str(tmp_path / "epoch_0_step_3")
    assert torch.equal(target.state["w"], torch.full((4,), 6.0))

    # the command line lists and verifies the format's snapshots as any other
    from tnt_snapshot_plugin.cli import cli

    result = CliRunner().invoke(cli, ["ls", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert listed["restore"] == "epoch_0_step_3"
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "epoch_0_step_3")])
    assert result.exit_code == 0, result.output


def test_a_format_nobody_registered_cannot_be_read(tmp_path, fmt):
    """A snapshot whose index names a format this process does not know is not restored as another."""
    config = SnapshotConfig.build(format=fmt, async_snapshot=False, preemption_signals=[])
    saver = Snapshotter(str(tmp_path), config)
    saver.train_start(["model"], 0, 0)
    saver.save(0, 1, {"model": Holder({"w": torch.zeros(2)})})
    saver.train_end(0, 1, lambda intra_epoch: {"model": Holder({"w": torch.zeros(2)})})
    unregister_format(fmt.name)
    verdict = verify.check(LocalStore(str(tmp_path)), "epoch_0_step_1")
    assert not verdict.intact and "torchsave-test" in (verdict.problem or "")


@pytest.mark.parametrize("bad", ["xyz", "", 3, None])
def test_a_bad_format_is_refused_naming_the_formats_before_the_dirpath_is_made(tmp_path, bad):
    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from tnt_snapshot_plugin.errors import ConfigError

    dirpath = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^format must be .*'torchsnapshot', 'dcp'.*got ") as refused:
        TorchSnapshotSaver(str(dirpath), format=bad)
    assert repr(bad) in str(refused.value)
    assert not dirpath.exists()
