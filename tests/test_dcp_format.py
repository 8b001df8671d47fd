"""DCP's format (``format="dcp"``) with real torchtnt and Lightning runs, real writes to disk, stock
``torch.distributed.checkpoint`` and torchtnt's own DCP saver on the other side, and gloo ranks.

One process: a torchtnt run resumes bitwise from the plugin's DCP snapshots; stock ``dcp.load`` and
torchtnt 0.2.4's ``DistributedCheckpointSaver.restore`` read them; the plugin restores checkpoints
that stock ``dcp.save`` and torchtnt's ``DistributedCheckpointSaver`` wrote; a Lightning fit
resumes with ``ckpt_path="last"``. Hostile and damaged snapshots: a ``.metadata`` whose pickle
would run code is refused by restore and verify with nothing run; a flipped byte is found by
verify and skipped by restore_from_latest. Several ranks (tests/dcp_worker.py): FSDP2 on 2 gloo
ranks, restored on 2 (bitwise, per-rank RNG exact), on 1 and on 4 (resharded by DCP's planner).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import launching
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchtnt.framework.train import train

from tnt_snapshot_plugin import (
    SnapshotCorruptError,
    SnapshotFallbackWarning,
    UnrestorableStateError,
    restore,
)
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.format import listing, verify
from tnt_snapshot_plugin.format.checksums import record_views
from tnt_snapshot_plugin.format.index import seal as seal_index
from tnt_snapshot_plugin.stores import LocalStore, open_store
from toy import Holder, StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, seed_everything, weights

METADATA, INDEX = ".metadata", ".tnt_snapshot_index.json"


def stateful_loader() -> StatefulDataLoader:
    x, y = make_data(40)
    return StatefulDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # 10 batches an epoch


def optimizer_state(unit: ToyUnit) -> dict[str, torch.Tensor]:
    state = unit.optimizer.state_dict()["state"]
    return {f"{p}/{k}": v.clone() for p, per in state.items() for k, v in per.items()}


@pytest.fixture
def quiet_stock_dcp():
    """Stock DCP warns that it runs without a process group (it then assumes one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# ------------------------------------------------------------------------------------------------
# One process


def test_torchtnt_resumes_bitwise_from_dcp_snapshots(tmp_path):
    """Weights, Adam's state, the LR schedule, progress, every RNG and a StatefulDataLoader's
    position come back exactly: the resumed run ends bitwise equal to an uninterrupted one."""
    seed_everything(7)
    reference = ToyUnit(seed=0)
    train(reference, stateful_loader(), max_epochs=2)

    seed_everything(7)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=6, format="dcp")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(ToyUnit(seed=0, fail_at_step=14), stateful_loader(), max_epochs=2, callbacks=[saver])
    newest = tmp_path / "epoch_1_step_12"
    assert (newest / METADATA).is_file() and not (newest / ".snapshot_metadata").exists()
    index = json.loads((newest / INDEX).read_text())
    assert index["snapshot_format"] == "dcp" and all(rel.startswith("0/") and rel.endswith(".distcp") for rel in index["files"])

    seed_everything(999)
    resumed = ToyUnit(seed=42)
    loader = stateful_loader()
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), resumed, train_dataloader=loader)
    assert resumed.train_progress.num_steps_completed == 12  # mid-epoch 2
    train(resumed, loader, max_epochs=2, callbacks=[TorchSnapshotSaver(str(tmp_path), format="dcp")])
    assert resumed.train_progress.num_steps_completed == 20
    assert_bitwise_equal(weights(resumed), weights(reference))
    assert_bitwise_equal(optimizer_state(resumed), optimizer_state(reference))
    assert resumed.lr_scheduler.get_last_lr() == reference.lr_scheduler.get_last_lr()


def test_a_staged_tensor_is_written_as_torch_save_writes_it_without_a_copy():
    """An asynchronous snapshot stages tensors as views into one arena: each is written as
    ``torch.save`` writes it alone (not the arena's whole storage), its bytes not copied."""
    import io

    import numpy as np

    from tnt_snapshot_plugin.format.dcp.writing import PACK_BYTES, serialized

    arena = torch.randn(3 * PACK_BYTES // 4)
    view = arena[PACK_BYTES // 4:].view(2, -1)
    views = serialized(view)
    expected = io.BytesIO()
    torch.save(view.clone(), expected)
    assert b"".join(bytes(v) for v in views) == expected.getvalue()
    assert any(isinstance(v, np.ndarray) and np.shares_memory(v, arena.numpy()) for v in views)
    small = arena[:10]
    assert len(serialized(small)) == 1 and torch.equal(torch.load(io.BytesIO(serialized(small)[0]), weights_only=True), small)


@pytest.mark.parametrize("kind", ["sparse", "quantized"])
def test_a_tensor_dcp_cannot_restore_stops_the_first_snapshot_naming_its_entry(tmp_path, kind):
    """DCP's reads copy each chunk into a dense tensor: a sparse or quantized tensor would be
    written and then never restored. The first snapshot refuses it, naming the entry; nothing is
    committed."""
    with warnings.catch_warnings():  # torch deprecates making quantized tensors; they still load
        warnings.simplefilter("ignore", UserWarning)
        value = torch.eye(3).to_sparse() if kind == "sparse" else torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    unit = ToyUnit()
    unit.extra = Holder({"dense": torch.ones(2), "odd": value})
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, format="dcp")
    with pytest.raises(UnrestorableStateError, match=r"'extra/odd'.*format='torchsnapshot'") as info:
        train(unit, StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver])
    assert ("sparse" if kind == "sparse" else "quantized") in str(info.value)
    assert listing.complete_snapshots(LocalStore(str(tmp_path))) == []


@pytest.fixture(scope="module")
def tnt_run(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A torchtnt run saving in DCP's format (asynchronously) at steps 2 and 4, and the state at
    step 4."""
    root = tmp_path_factory.mktemp("dcp_run")
    captured: dict[str, Any] = {}

    class Capture(TorchSnapshotSaver):
        def on_train_step_end(self, state, unit):
            super().on_train_step_end(state, unit)
            if unit.train_progress.num_steps_completed == 4:
                captured.update(
                    model=weights(unit), optim=optimizer_state(unit), lr=unit.lr_scheduler.get_last_lr(),
                    loader=unit_loader.state_dict(), extra=dict(unit.extra.state),
                )

    seed_everything(3)
    unit = ToyUnit()
    unit.extra = Holder({"big": torch.randn(1_200_000), "count": 3, "name": "x", "pair": (1, "two"), "ids": {1: torch.ones(2)}})
    unit_loader = StatefulLoader(make_data(16))  # 4 steps: snapshots at steps 2 and 4
    saver = Capture(str(root), save_every_n_train_steps=2, save_on_train_end=False, format="dcp")
    train(unit, unit_loader, max_epochs=1, callbacks=[saver])
    return root, captured


def test_stock_dcp_load_reads_the_plugins_snapshot(tnt_run, quiet_stock_dcp):
    root, captured = tnt_run
    fresh = ToyUnit(seed=11)
    sd = {"app_state": {
        "model": fresh.model.state_dict(),
        "extra": {"big": torch.zeros(1_200_000), "count": 0, "name": "", "pair": None, "ids": {1: torch.zeros(2)}},
        "train_progress": fresh.train_progress.state_dict(),
    }}
    dcp.load(sd, checkpoint_id=str(root / "epoch_0_step_4"))
    assert_bitwise_equal(sd["app_state"]["model"], captured["model"])
    extra = sd["app_state"]["extra"]
    assert torch.equal(extra["big"], captured["extra"]["big"]) and torch.equal(extra["ids"][1], torch.ones(2))
    assert (extra["count"], extra["name"], extra["pair"]) == (3, "x", (1, "two"))
    assert sd["app_state"]["train_progress"]["num_steps_completed"] == 4
    # the whole checkpoint, rebuilt from the metadata alone (DCP's format conversion)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(root / "epoch_0_step_4"), str(root.parent / "whole.pt"))
    whole = torch.load(root.parent / "whole.pt", weights_only=False)
    assert torch.equal(whole["app_state"]["model"]["0.weight"], captured["model"]["0.weight"])


def test_torchtnts_dcp_restore_reads_the_plugins_snapshot(tnt_run, quiet_stock_dcp):
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver

    root, captured = tnt_run
    fresh = ToyUnit(seed=11)
    fresh.extra = Holder({"big": torch.zeros(1_200_000), "count": 0, "name": "", "pair": None, "ids": {1: torch.zeros(2)}})
    loader = StatefulLoader(make_data(16))
    DistributedCheckpointSaver.restore(str(root / "epoch_0_step_4"), fresh, train_dataloader=loader)
    assert_bitwise_equal(weights(fresh), captured["model"])
    assert_bitwise_equal(optimizer_state(fresh), captured["optim"])
    assert fresh.lr_scheduler.get_last_lr() == captured["lr"]
    assert fresh.train_progress.num_steps_completed == 4
    assert loader.state_dict() == captured["loader"]
    assert fresh.extra.state["count"] == 3 and torch.equal(fresh.extra.state["big"], captured["extra"]["big"])


def test_the_plugin_restores_what_stock_dcp_save_wrote(tmp_path, quiet_stock_dcp):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    other = {"step": 7, "note": "n", "t": torch.arange(5)}
    dcp.save({"app_state": {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "other": other}},
             checkpoint_id=str(tmp_path / "ckpt"))

    fresh = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    holder = Holder({})
    keys = restore(str(tmp_path / "ckpt"), {"model": fresh, "optimizer": fresh_optimizer, "other": holder})
    assert keys == ["model", "optimizer", "other"]
    assert_bitwise_equal(fresh.state_dict(), model.state_dict())
    saved, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    # DCP stores keys as strings; the parameter ids come back as the optimizer's own (ints)
    assert loaded["state"].keys() == saved["state"].keys()
    for p in saved["state"]:
        assert_bitwise_equal(loaded["state"][p], saved["state"][p])
    assert holder.state["step"] == 7 and holder.state["note"] == "n" and torch.equal(holder.state["t"], torch.arange(5))

    # verify: intact, with a note that no index records sizes and checksums
    verdict = verify.check(LocalStore(str(tmp_path)), "ckpt", checksums=True)
    assert verdict.intact, verdict.problems
    assert any("not written by this plugin" in note for note in verdict.notes)


def test_a_record_that_is_not_its_chunk_is_found_by_the_deep_verify_and_refused_by_restore(tmp_path, quiet_stock_dcp):
    """A checkpoint of dcp.save whose metadata points a tensor at another tensor's record (long
    enough, so only decoding it tells): verify --checksums finds it, restore refuses it."""
    dcp.save({"a": torch.arange(6.0), "b": torch.arange(4, dtype=torch.int64)}, checkpoint_id=str(tmp_path / "ckpt"))
    meta = pickle.loads((tmp_path / "ckpt" / METADATA).read_bytes())  # the test's own checkpoint
    where = {index.fqn: (index, info) for index, info in meta.storage_data.items()}
    meta.storage_data[where["b"][0]] = where["a"][1]
    (tmp_path / "ckpt" / METADATA).write_bytes(pickle.dumps(meta))

    store = LocalStore(str(tmp_path))
    assert verify.check(store, "ckpt").intact  # sizes and structure add up
    verdict = verify.check(store, "ckpt", checksums=True)
    assert verdict.problem == f"entry b: its record in {where['a'][1].relative_path} does not hold the chunk its entry describes"
    result = CliRunner().invoke(cli, ["verify", str(tmp_path / "ckpt")])
    assert result.exit_code == 1 and "does not hold the chunk" in result.output
    with pytest.raises(SnapshotCorruptError, match="entry b.*does not hold the chunk its entry describes"):
        restore(str(tmp_path / "ckpt"), {"b": Holder(torch.zeros(4, dtype=torch.int64))})


def test_the_plugin_restores_what_torchtnts_dcp_saver_wrote(tmp_path, quiet_stock_dcp):
    """torchtnt's own DistributedCheckpointSaver's checkpoints (``epoch_E_train_step_S``) are
    found by restore_from_latest and restored by path."""
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver

    seed_everything(1)
    unit = ToyUnit()
    captured: dict[str, Any] = {}

    class Capture(DistributedCheckpointSaver):
        def on_train_step_end(self, state, unit):
            super().on_train_step_end(state, unit)
            captured[unit.train_progress.num_steps_completed] = (weights(unit), optimizer_state(unit))

    train(unit, StatefulLoader(make_data(16)), max_epochs=1,
          callbacks=[Capture(str(tmp_path), save_every_n_train_steps=2, async_checkpoint=False)])
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("epoch_"))
    assert "epoch_0_train_step_4" in names

    fresh = ToyUnit(seed=5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert fresh.train_progress.num_steps_completed == 4
    assert_bitwise_equal(weights(fresh), captured[4][0])
    assert_bitwise_equal(optimizer_state(fresh), captured[4][1])
    older = ToyUnit(seed=5)
    TorchSnapshotSaver.restore(str(tmp_path / "epoch_0_train_step_2"), older)
    assert_bitwise_equal(weights(older), captured[2][0])


def resume_bitwise_on(url: str, storage: dict[str, Any]) -> None:
    """A torchtnt run saving DCP snapshots to ``url`` (retention keeping 2) fails at step 13; a
    new unit resumes from the latest and ends bitwise equal to an uninterrupted run."""
    seed_everything(7)
    reference = ToyUnit(seed=0)
    train(reference, StatefulLoader(make_data(40), seed=3), max_epochs=2)

    seed_everything(7)
    saver = TorchSnapshotSaver(url, save_every_n_train_steps=4, storage_options=storage, keep_last_n_checkpoints=2, format="dcp")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(ToyUnit(seed=0, fail_at_step=13), StatefulLoader(make_data(40), seed=3), max_epochs=2, callbacks=[saver])
    store = open_store(url, storage)
    assert [s.text for s in listing.complete_snapshots(store)] == ["epoch_0_step_8", "epoch_1_step_12"]
    verdict = verify.check(store, "epoch_1_step_12", checksums=True)
    assert verdict.intact and not verdict.notes, (verdict.problems, verdict.notes)

    seed_everything(99)
    resumed = ToyUnit(seed=123)
    loader = StatefulLoader(make_data(40), seed=3)
    assert TorchSnapshotSaver.restore_from_latest(url, resumed, train_dataloader=loader, storage_options=storage)
    assert resumed.train_progress.num_steps_completed == 12
    train(resumed, loader, max_epochs=2)
    assert_bitwise_equal(weights(resumed), weights(reference))


@pytest.mark.slow
def test_dcp_snapshots_on_s3_resume_bitwise(s3_options, run_url, monkeypatch):
    """On moto's S3 server, through the plugin's S3 store (the metadata written last); nothing
    reaches S3 through the environment."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # a closed port
    resume_bitwise_on(run_url, s3_options)


def test_dcp_snapshots_on_an_fsspec_store_resume_bitwise():
    """On fsspec's memory filesystem, through the fsspec store."""
    resume_bitwise_on(f"memory://run-{uuid.uuid4().hex[:8]}", {})


def test_lightning_resumes_bitwise_from_dcp_snapshots_with_ckpt_path_last(tmp_path):
    from lightning_toy import ResumableLoader, ToyModule, make_trainer, optimizer_tensors

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver as LightningSaver

    def loader() -> ResumableLoader:
        return ResumableLoader(make_data(40), seed=3)  # 10 batches an epoch

    seed_everything(7)
    reference = ToyModule(seed=0)
    ref_trainer = make_trainer(tmp_path / "ref", [], enable_checkpointing=False)
    ref_trainer.fit(reference, loader())

    dirpath = str(tmp_path / "snaps")
    seed_everything(7)
    saver = LightningSaver(dirpath, save_every_n_train_steps=6, format="dcp")
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(ToyModule(seed=0, fail_at_step=15), loader())
    assert (Path(dirpath) / "epoch_1_step_12" / METADATA).is_file()

    seed_everything(999)
    module = ToyModule(seed=42)
    trainer = make_trainer(tmp_path, [LightningSaver(dirpath, save_on_train_end=False, format="dcp")])
    trainer.fit(module, loader(), ckpt_path="last")
    assert trainer.ckpt_path == os.path.join(dirpath, "epoch_1_step_12")  # mid-epoch 2
    assert trainer.global_step == ref_trainer.global_step == 20
    assert_bitwise_equal(dict(module.state_dict()), dict(reference.state_dict()))
    assert_bitwise_equal(optimizer_tensors(trainer), optimizer_tensors(ref_trainer))


# ------------------------------------------------------------------------------------------------
# Hostile and damaged snapshots


OLD, NEW = "epoch_0_step_2", "epoch_0_step_4"


@pytest.fixture
def run_copy(tnt_run, tmp_path) -> Path:
    root, _ = tnt_run
    run = tmp_path / "run"
    shutil.copytree(root, run)
    return run


def _reseal(snapshot: Path, rel: str, data: bytes) -> None:
    """``rel`` rewritten as ``data``, the index made to agree with it and sealed again (as an
    attacker who can write the snapshot would)."""
    (snapshot / rel).write_bytes(data)
    index = json.loads((snapshot / INDEX).read_text())
    index.pop("seal", None)
    index["checksums"][rel] = record_views([memoryview(data)])
    if rel != METADATA:
        index["files"][rel] = len(data)
    (snapshot / INDEX).write_bytes(seal_index(index))


class _Planted:
    """Unpickling this creates a directory: proof that code from a snapshot ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _metadata_with(snapshot: Path, planted: Any) -> bytes:
    """The snapshot's own metadata with ``planted`` in one of its fields."""
    meta = pickle.loads((snapshot / METADATA).read_bytes())
    meta.storage_meta.save_id = planted
    return pickle.dumps(meta)


HOSTILE = {
    "a pickle that would run code": (lambda s, marker: pickle.dumps(_Planted(marker)), "posix.mkdir"),
    "code planted inside the metadata": (lambda s, marker: _metadata_with(s, _Planted(marker)), "posix.mkdir"),
    "a class outside DCP's": (lambda s, marker: _metadata_with(s, __import__("datetime").date(2026, 1, 1)), "datetime.date"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_metadata_is_refused_by_restore_and_verify_and_nothing_runs(run_copy, tmp_path, case):
    make, named = HOSTILE[case]
    marker = tmp_path / "marker"
    _reseal(run_copy / NEW, METADATA, make(run_copy / NEW, str(marker)))

    verdict = verify.check(LocalStore(str(run_copy)), NEW, checksums=True)
    assert not verdict.intact and named in (verdict.problem or ""), verdict.problems
    result = CliRunner().invoke(cli, ["verify", str(run_copy / NEW)])
    assert result.exit_code == 1 and named in result.output and "Traceback" not in result.output

    with pytest.raises(SnapshotCorruptError, match=named.replace(".", r"\.")):
        restore(str(run_copy / NEW), {"model": ToyUnit().model})
    fresh = ToyUnit(seed=5)
    fresh.extra = Holder({"big": torch.zeros(1_200_000), "count": 0, "name": "", "pair": None, "ids": {}})
    with pytest.warns(SnapshotFallbackWarning, match=rf"skipping damaged snapshot \S*{NEW}: .*{named}"):
        assert TorchSnapshotSaver.restore_from_latest(str(run_copy), fresh)
    assert fresh.train_progress.num_steps_completed == 2
    assert not marker.exists()


def test_a_flipped_byte_in_a_distcp_file_is_found_by_verify_and_restore_falls_back(run_copy):
    newest = run_copy / NEW
    payloads = sorted(newest.glob("0/*.distcp"), key=lambda p: p.stat().st_size)
    for path in (payloads[0], payloads[-1]):  # a pack of small records, and a large tensor's own file
        original = path.read_bytes()
        data = bytearray(original)
        data[len(data) // 2] ^= 0x5A
        path.write_bytes(bytes(data))
        assert not verify.check(LocalStore(str(run_copy)), NEW).problems  # sizes and metadata: intact
        verdict = verify.check(LocalStore(str(run_copy)), NEW, checksums=True)
        assert f"file 0/{path.name} differs from the xxh3_64 checksum" in (verdict.problem or "")

        fresh = ToyUnit(seed=5)
        fresh.extra = Holder({"big": torch.zeros(1_200_000), "count": 0, "name": "", "pair": None, "ids": {}})
        with pytest.warns(SnapshotFallbackWarning, match=rf"skipping damaged snapshot \S*{NEW}"):
            assert TorchSnapshotSaver.restore_from_latest(str(run_copy), fresh, train_dataloader=StatefulLoader(make_data(16)))
        assert fresh.train_progress.num_steps_completed == 2
        path.write_bytes(original)


# ------------------------------------------------------------------------------------------------
# Several ranks (tests/dcp_worker.py)

WORKER = Path(__file__).with_name("dcp_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("dcp_ranks")
    runs = {"save": launching.run_phase(WORKER, "save", 2, out)}
    for phase, world_size in (("restore", 2), ("world1", 1), ("world4", 4)):
        runs[phase] = launching.run_phase(WORKER, phase, world_size, out)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("wrapping", ["fsdp2", "ddp"])
def test_two_ranks_save_dcp_and_restore_bitwise_with_each_ranks_own_values(ranks, wrapping):
    for rank, (saved, restored) in enumerate(zip(ranks["save"], ranks["restore"], strict=True)):
        saved, result = saved[wrapping], restored[wrapping]
        assert saved["committed"] == ["epoch_0_step_2", "epoch_0_step_4"] and not saved["warnings"]
        assert saved["files"] and all(f.startswith(f"__{rank}_") and f.endswith(".distcp") for f in saved["files"])
        assert result["restored"] is True and result["steps"] == 4 and not result["warnings"]
        expected = saved["at_step_4"]
        assert result["whole"] == expected["whole"]
        assert result["rng"] == expected["rng"]  # each rank's own RNG state
        assert result["tally"] == expected["tally"] == [[rank], f"rank {rank}"]
    assert ranks["save"][0][wrapping]["at_step_4"]["rng"] != ranks["save"][1][wrapping]["at_step_4"]["rng"]
    entries = ranks["save"][0][wrapping]["entries"]
    assert "per_rank.1.tally.rank" in entries and "per_rank.0.rng_state.rng_state" in entries
    # the model is shared (FSDP2: each rank's chunks; DDP: replicated, written once), not per rank
    assert any(e.startswith("app_state.model.") for e in entries)
    assert not any(e.startswith(("per_rank.0.model.", "per_rank.1.model.")) for e in entries)


@pytest.mark.slow
def test_torchtnts_dcp_restore_reads_a_snapshot_of_two_ranks(ranks):
    """torchtnt's DCP restore, which knows no per-rank values, gets rank 0's on every rank."""
    for restored in ranks["restore"]:
        expected = ranks["save"][0]["fsdp2"]["at_step_4"]["whole"]
        by_torchtnt = restored["torchtnt"]
        assert by_torchtnt["model"] == {k: v for k, v in expected.items() if k.startswith("model/")}
        assert by_torchtnt["steps"] == 4 and by_torchtnt["tally"] == [[0], "rank 0"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["world1", "world4"])
@pytest.mark.parametrize("wrapping", ["fsdp2", "ddp"])
def test_a_two_rank_dcp_snapshot_restores_onto_one_and_four_ranks(ranks, phase, wrapping):
    """DCP's planner reshards FSDP2's model and Adam's state; DDP's replicated model, and values
    equal on both saved ranks (DDP's optimizer state, the progress), map onto any rank; the RNG
    states (per rank) are not restored, with a warning; a per-rank tally, different on each
    saved rank, is refused by name."""
    expected = ranks["save"][0][wrapping]["at_step_4"]["whole"]
    for record in ranks[phase]:
        assert "tally" in record["tally"]["refused"] and "cannot restore" in record["tally"]["refused"]
        result = record[wrapping]
        assert result["restored"] is True and result["steps"] == 4
        assert result["whole"] == expected
        assert any("RNG states are per rank" in w for w in result["warnings"]), result["warnings"]
    if phase == "world1" and wrapping == "fsdp2":
        stock = ranks[phase][0]["stock"]
        assert stock == {k: v for k, v in expected.items() if k.startswith("model/")}
