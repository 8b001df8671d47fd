"""``tnt-snapshot convert`` against snapshots of real torchtnt runs, stock readers on the other side.

Between the formats: a one-rank run's snapshot goes torchsnapshot -> DCP -> torchsnapshot and each
copy restores into a fresh unit with every entry bitwise equal (the plugin's own: progress, the
RNG states, the dataloader's position), and training resumed from the DCP copy ends as an
uninterrupted run; stock ``dcp.load`` and stock torchsnapshot (in a process that never imports
the plugin) read what convert wrote; checkpoints of stock ``dcp.save`` and of torchtnt's DCP saver
convert too. Two gloo ranks (tests/convert_worker.py): a DDP run's snapshot round trips with each
rank's own values, an FSDP2 run's DCP snapshot converts to torchsnapshot's format and restores into
FSDP2, and torchsnapshot's sharded entries are refused by name. Weights: ``--to torch`` and
``--to safetensors`` (sharded with Hugging Face's index) load with ``torch.load`` and
``safetensors.torch.load_file``. A failure (a fault injected into a write, a full disk) leaves
nothing; bad arguments are one line, before any work; S3 on moto's server both ways.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import launching
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from moto_s3 import BUCKET, create_bucket, moto_options
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.format import verify
from tnt_snapshot_plugin.stores import LocalStore, open_store
from toy import (
    Holder,
    StatefulLoader,
    ToyUnit,
    assert_bitwise_equal,
    make_data,
    seed_everything,
    small_disk,
    weights,
)

HERE = Path(__file__).parent
NAME = "epoch_1_step_9"  # mid-epoch: the dataloader's position is saved
INDEX = ".tnt_snapshot_index.json"


def run_cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def convert(src: Path | str, dst: Path | str, to: str, *extra: str) -> str:
    code, out, err = run_cli("convert", str(src), str(dst), "--to", to, *extra)
    assert code == 0 and err == "", (code, out, err)
    return out


def extra_state() -> dict[str, Any]:
    return {
        "w": torch.arange(16.0), "bf": torch.arange(4, dtype=torch.bfloat16), "ids": {1: torch.ones(2), 7: torch.zeros(1)},
        "count": 3, "name": "x", "pair": (1, "two"), "nested": [1, [2, 3]], "none": None,
    }


def fresh_unit(seed: int = 11) -> ToyUnit:
    unit = ToyUnit(seed=seed)
    unit.extra = Holder({})
    return unit


def loader() -> StatefulLoader:
    return StatefulLoader(make_data(20), seed=3)  # 5 steps an epoch


@pytest.fixture(scope="module")
def tnt_run(tmp_path_factory) -> Path:
    """A torchtnt run of 2 epochs in torchsnapshot's format, snapshots every 3 steps."""
    root = tmp_path_factory.mktemp("convert_run") / "run"
    seed_everything(7)
    unit = ToyUnit(seed=0)
    unit.extra = Holder(extra_state())
    saver = TorchSnapshotSaver(str(root), save_every_n_train_steps=3, save_on_train_end=False, async_checkpoint=False)
    train(unit, loader(), max_epochs=2, callbacks=[saver])
    assert (root / NAME / ".snapshot_metadata").is_file()
    return root


def restored(path: Path | str, **options: Any) -> dict[str, Any]:
    """Everything a fresh unit holds once restored from ``path``: its entries, the dataloader's
    position and the process's RNG states."""
    unit = fresh_unit()
    data = loader()
    seed_everything(999)
    TorchSnapshotSaver.restore(str(path), unit, train_dataloader=data, **options)
    return {
        "model": unit.model.state_dict(), "optimizer": unit.optimizer.state_dict(),
        "lr_scheduler": unit.lr_scheduler.state_dict(), "train_progress": unit.train_progress.state_dict(),
        "eval_progress": unit.eval_progress.state_dict(), "extra": unit.extra.state, "loader": data.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ: types, keys, tensors' dtypes, shapes and bytes, values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} / {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} / {b.dtype}{list(b.shape)}"]
        same = torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        return [] if same else [f"{path}: bytes differ"]
    if isinstance(a, np.ndarray):
        return [] if isinstance(b, np.ndarray) and np.array_equal(a, b) else [f"{path}: arrays differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(repr, a))} / {sorted(map(repr, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {a!r} / {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}/{i}")]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} / {b!r}"]


# ------------------------------------------------------------------------------------------------
# One rank


def test_a_torchtnt_snapshot_round_trips_bitwise_through_dcp(tnt_run, tmp_path):
    src = tnt_run / NAME
    out = convert(src, tmp_path / "dcp" / NAME, "dcp")
    assert f"to {tmp_path / 'dcp' / NAME} (dcp" in out
    convert(tmp_path / "dcp" / NAME, tmp_path / "rt" / NAME, "torchsnapshot")

    expected = restored(src)
    assert expected["train_progress"]["num_steps_completed"] == 9 and expected["loader"]
    for copy in (tmp_path / "dcp" / NAME, tmp_path / "rt" / NAME):
        assert differences(expected, restored(copy)) == [], copy
    # the same entries, read by the command line from every copy (a list DCP stores whole, by item)
    for copy in (tmp_path / "dcp" / NAME, tmp_path / "rt" / NAME):
        code, out, _ = run_cli("diff", str(src), str(copy))
        assert code == 0 and out.endswith("identical\n") and "added" not in out, out

    # each is a snapshot of the plugin's: its format, the index's checksums, intact
    for fmt, copy in (("dcp", tmp_path / "dcp"), ("torchsnapshot", tmp_path / "rt")):
        index = json.loads((copy / NAME / INDEX).read_text())
        assert index.get("snapshot_format", "torchsnapshot") == fmt
        assert set(index["checksums"]) >= set(index["files"]) and index["world_size"] == 1
        verdict = verify.check(LocalStore(str(copy)), NAME, checksums=True)
        assert verdict.intact and not verdict.notes, (verdict.problems, verdict.notes)
        assert sorted(os.listdir(copy)) == [NAME]  # no staging directory left


def test_training_resumed_from_a_converted_snapshot_ends_as_an_uninterrupted_run(tnt_run, tmp_path):
    seed_everything(7)
    reference = ToyUnit(seed=0)
    reference.extra = Holder(extra_state())
    train(reference, loader(), max_epochs=2)

    convert(tnt_run / NAME, tmp_path / "dcp" / NAME, "dcp")
    resumed = fresh_unit()
    data = loader()
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "dcp"), resumed, train_dataloader=data)
    train(resumed, data, max_epochs=2)
    assert resumed.train_progress.num_steps_completed == 10
    assert_bitwise_equal(weights(resumed), weights(reference))


@pytest.fixture
def quiet_stock_dcp():
    """Stock DCP warns that it runs without a process group (it then assumes one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def test_stock_readers_read_what_convert_wrote(tnt_run, tmp_path, quiet_stock_dcp):
    src = tnt_run / NAME
    expected = restored(src)
    convert(src, tmp_path / "dcp" / NAME, "dcp")
    convert(tmp_path / "dcp" / NAME, tmp_path / "ts" / NAME, "torchsnapshot")

    # torch.distributed.checkpoint.load, into the state dicts of a fresh unit
    fresh = fresh_unit()
    state = {"app_state": {
        "model": fresh.model.state_dict(), "train_progress": fresh.train_progress.state_dict(),
        "extra": {"w": torch.zeros(16), "bf": torch.zeros(4, dtype=torch.bfloat16), "count": 0, "pair": None},
    }}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp" / NAME))
    assert differences(dict(expected["model"]), dict(state["app_state"]["model"])) == []
    assert state["app_state"]["train_progress"]["num_steps_completed"] == 9
    extra = state["app_state"]["extra"]
    assert differences({k: expected["extra"][k] for k in extra}, extra) == []

    # stock torchsnapshot, in a process that never imports the plugin
    out = tmp_path / "stock.pt"
    proc = subprocess.run([sys.executable, str(HERE / "stock_reader.py"), "single", str(out), str(tmp_path / "ts" / NAME)],
                          capture_output=True, text=True, timeout=launching.DEADLINE_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    stock = torch.load(out, weights_only=False)["plain"]
    assert differences(dict(expected["model"]), dict(stock["model"])) == []
    assert stock["train_progress"] == expected["train_progress"]
    assert differences(expected["extra"]["w"], stock["extra"]["w"]) == [] and stock["extra"]["pair"] == (1, "two")


def test_checkpoints_of_stock_dcp_and_torchtnts_dcp_saver_convert(tmp_path, quiet_stock_dcp):
    from torchtnt.framework.callbacks.dcp_saver import DistributedCheckpointSaver

    seed_everything(1)
    unit = ToyUnit()
    train(unit, StatefulLoader(make_data(16)), max_epochs=1,
          callbacks=[DistributedCheckpointSaver(str(tmp_path / "tnt"), save_every_n_train_steps=4, async_checkpoint=False)])
    convert(tmp_path / "tnt" / "epoch_0_train_step_4", tmp_path / "out" / "epoch_0_step_4", "torchsnapshot")
    fresh = ToyUnit(seed=5)
    TorchSnapshotSaver.restore(str(tmp_path / "out" / "epoch_0_step_4"), fresh)
    assert fresh.train_progress.num_steps_completed == 4
    assert_bitwise_equal(weights(fresh), weights(unit))
    assert differences(fresh.optimizer.state_dict()["state"], unit.optimizer.state_dict()["state"]) == []

    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict(), "step": 7, "note": "n"}, checkpoint_id=str(tmp_path / "stock" / "epoch_0_step_7"))
    convert(tmp_path / "stock" / "epoch_0_step_7", tmp_path / "out" / "epoch_0_step_7", "torchsnapshot")
    code, out, _ = run_cli("inspect", str(tmp_path / "out" / "epoch_0_step_7"), "--json")
    rows = {row["path"]: row for row in json.loads(out)["entries"]}
    assert rows["0/step"]["value"] == 7 and rows["0/note"]["value"] == "n" and rows["0/model/weight"]["shape"] == [3, 4]
    holder = Holder({})
    from tnt_snapshot_plugin import restore

    restore(str(tmp_path / "out" / "epoch_0_step_7"), {"model": (target := torch.nn.Linear(4, 3)), "step": holder})
    assert_bitwise_equal(target.state_dict(), model.state_dict())


# ------------------------------------------------------------------------------------------------
# Model weights: torch.save and safetensors


def test_weights_to_torch_and_safetensors_load_with_the_same_tensors(tnt_run, tmp_path):
    from safetensors.torch import load_file

    src = tnt_run / NAME
    expected = dict(restored(src)["model"])
    out = convert(src, tmp_path / "model.pt", "torch")
    assert "wrote model (4 tensors" in out
    assert differences(expected, dict(torch.load(tmp_path / "model.pt", weights_only=True))) == []

    convert(src, tmp_path / "whole", "safetensors")
    assert sorted(os.listdir(tmp_path / "whole")) == ["model.safetensors"]
    assert differences(expected, load_file(tmp_path / "whole" / "model.safetensors")) == []

    # above --max-shard-size: shards as Hugging Face names them, and their index
    code, out, err = run_cli("convert", str(src), str(tmp_path / "sharded"), "--to", "safetensors",
                             "--max-shard-size", "300B", "--json")
    assert code == 0, err
    files = json.loads(out)["files"]
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert sorted(os.listdir(tmp_path / "sharded")) == sorted(files)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    assert set(index["weight_map"]) == set(expected)
    loaded: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        shard = load_file(tmp_path / "sharded" / file)
        assert all(index["weight_map"][name] == file for name in shard)
        assert sum(t.numel() * t.element_size() for t in shard.values()) <= 300 or len(shard) == 1
        loaded.update(shard)
    assert differences(expected, loaded) == []

    # from a DCP snapshot too, a sub-entry by --key
    convert(src, tmp_path / "dcp" / NAME, "dcp")
    convert(tmp_path / "dcp" / NAME, tmp_path / "w0", "safetensors", "--key", "model/0.weight")
    assert differences({"0.weight": expected["0.weight"]}, load_file(tmp_path / "w0" / "model.safetensors")) == []


def test_max_shard_size_reads_sizes_as_hugging_face_writes_them():
    from tnt_snapshot_plugin.cli.weights import parse_size, shards

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500mb") == 5 * 10**8
    assert parse_size("1000") == 1000 and parse_size("1.5KB") == 1500
    for bad in ("", "GB", "-1GB", "0", "five"):
        with pytest.raises(ValueError):
            parse_size(bad)
    tensors = {"a": torch.zeros(10), "b": torch.zeros(20), "c": torch.zeros(5), "d": torch.zeros(1)}  # 40, 80, 20, 4 bytes
    assert shards(tensors, 100) == [["a"], ["b", "c"], ["d"]]
    assert shards(tensors, 60) == [["a"], ["b"], ["c", "d"]]  # a tensor above the limit alone
    assert shards(tensors, 10**9) == [["a", "b", "c", "d"]]


# ------------------------------------------------------------------------------------------------
# Failures leave nothing; bad arguments are refused before any work


def test_a_fault_in_the_middle_of_the_write_leaves_no_dst(tnt_run, tmp_path, faulty_local):
    out = tmp_path / "out"
    out.mkdir()
    faulty, url = faulty_local(out)
    faulty.inject("write_payload", OSError(5, "Input/output error (injected)"), nth=2)
    code, stdout, err = run_cli("convert", str(tnt_run / NAME), f"{url}/{NAME}", "--to", "dcp")
    assert code == 1 and stdout == "" and err.count("\n") == 1 and "Input/output error (injected)" in err, err
    assert os.listdir(out) == []  # no DST, no staging directory, no half file
    faulty.clear()
    convert(tnt_run / NAME, f"{url}/{NAME}", "dcp")  # the same conversion, once the storage works
    assert os.listdir(out) == [NAME]


def test_a_full_disk_leaves_nothing(tmp_path):
    from toy import unit_with_payload

    train(unit := unit_with_payload(), StatefulLoader(make_data(8)), max_epochs=1,
          callbacks=[TorchSnapshotSaver(str(tmp_path / "run"), save_every_n_train_steps=2, async_checkpoint=False)])
    src = tmp_path / "run" / "epoch_0_step_2"
    with small_disk(tmp_path / "disk", 256 * 1024) as disk:
        for args in (
            [str(disk / "snaps" / "epoch_0_step_2"), "--to", "dcp"],
            [str(disk / "snaps" / "epoch_0_step_2"), "--to", "torchsnapshot"],
            [str(disk / "payload.pt"), "--to", "torch", "--key", "payload"],
            [str(disk / "payload"), "--to", "safetensors", "--key", "payload"],
        ):
            code, out, err = run_cli("convert", str(src), *args)
            assert code == 1 and err.count("\n") == 1 and "No space left on device" in err, (args, code, out, err)
            left = [os.path.join(root, n) for root, dirs, files in os.walk(disk) for n in dirs + files]
            assert left in ([], [str(disk / "snaps")]), (args, left)  # at most the empty folder DST was to go in
    assert unit.payload.state["big"].numel() * 4 > 256 * 1024


def test_bad_arguments_are_one_line_errors_before_any_work(tnt_run, tmp_path):
    src = str(tnt_run / NAME)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / NAME).mkdir()
    (tmp_path / "exists.pt").write_bytes(b"mine")
    (tmp_path / "notes").mkdir()
    cases = [
        (["convert", src, str(tmp_path / "a" / NAME), "--to", "onnx"], "Invalid value for '--to'"),
        (["convert", src, str(tmp_path / "a" / NAME)], "Missing option '--to'"),
        (["convert", src, str(tmp_path / "taken" / NAME), "--to", "dcp"], f"DST {tmp_path / 'taken' / NAME} exists"),
        (["convert", src, str(tmp_path / "exists.pt"), "--to", "torch"], f"DST {tmp_path / 'exists.pt'} exists"),
        (["convert", src, str(tmp_path / "a" / "converted"), "--to", "dcp"], "is not named like a snapshot (epoch_E_step_S)"),
        (["convert", str(tmp_path / "notes"), str(tmp_path / "a" / NAME), "--to", "dcp"], "is not a complete snapshot"),
        (["convert", str(tmp_path / "missing" / NAME), str(tmp_path / "a" / NAME), "--to", "dcp"], "does not exist"),
        (["convert", str(tnt_run), str(tmp_path / "a" / NAME), "--to", "dcp"], "is a directory of snapshots"),
        (["convert", src, str(tmp_path / "a" / NAME), "--to", "dcp", "--key", "model"], "--key applies to --to torch"),
        (["convert", src, "s3://bucket/model.pt", "--to", "torch"], "is a URL; --to torch writes a local file"),
        (["convert", src, str(tmp_path / "nowhere" / "model.pt"), "--to", "torch"], "does not exist; create it"),
        (["convert", src, str(tmp_path / "st"), "--to", "safetensors", "--max-shard-size", "big"], "is not a size"),
        (["convert", src, str(tmp_path / "st"), "--to", "safetensors", "--key", "optimizer"],
         "cannot convert 'optimizer' as safetensors"),
        (["convert", src, str(tmp_path / "st"), "--to", "torch", "--key", "train_progress"], "holds no tensors"),
    ]
    for args, expected in cases:
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 2 and result.stdout == "", (args, result.stdout, result.stderr)
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("tnt-snapshot: error: "), (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
    assert sorted(os.listdir(tmp_path)) == ["exists.pt", "notes", "taken"]  # nothing made
    assert (tmp_path / "exists.pt").read_bytes() == b"mine" and os.listdir(tmp_path / "taken" / NAME) == []


def test_a_large_conversion_shows_a_progress_bar_on_a_terminal_only(tnt_run, tmp_path, monkeypatch):
    from rich.console import Console

    from tnt_snapshot_plugin.cli import convert as command

    shown = io.StringIO()
    monkeypatch.setattr(command, "PROGRESS_BYTES", 1)  # the toy snapshot counts as large
    monkeypatch.setattr(command, "console", lambda err=False: Console(file=shown, force_terminal=True) if err else
                        Console(file=io.StringIO()))
    convert(tnt_run / NAME, tmp_path / "a" / NAME, "dcp")
    assert "reading" in shown.getvalue() or "writing" in shown.getvalue(), shown.getvalue()
    for quiet in (["--quiet"], ["--json"]):
        shown.seek(0)
        shown.truncate()
        code, out, err = run_cli("convert", str(tnt_run / NAME), str(tmp_path / f"b{len(quiet[0])}" / NAME), "--to", "dcp", *quiet)
        assert code == 0 and shown.getvalue() == "", quiet
        assert (out == "") == (quiet == ["--quiet"])
    monkeypatch.setattr(command, "PROGRESS_BYTES", 1 << 40)
    convert(tnt_run / NAME, tmp_path / "c" / NAME, "dcp")
    assert shown.getvalue() == ""  # a small conversion: no bar


# ------------------------------------------------------------------------------------------------
# S3


@pytest.mark.slow
def test_convert_to_and_from_s3(tnt_run, tmp_path, moto_endpoint, no_aws_environment):
    options = moto_options(moto_endpoint)
    create_bucket(options)
    url = f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    flag = ["--endpoint-url", moto_endpoint]

    code, out, err = run_cli("convert", str(tnt_run / NAME), f"{url}/{NAME}", "--to", "dcp", *flag, env=env)
    assert code == 0, err
    store = open_store(url, options)
    assert store.list_names() == [NAME] and verify.check(store, NAME, checksums=True).intact
    expected = restored(tnt_run / NAME)
    assert differences(expected, restored(f"{url}/{NAME}", storage_options=options)) == []

    code, _, err = run_cli("convert", f"{url}/{NAME}", f"{url}/{NAME}", "--to", "torchsnapshot", *flag, env=env)
    assert code == 2 and "exists" in err
    code, out, err = run_cli("convert", f"{url}/{NAME}", str(tmp_path / "back" / NAME), "--to", "torchsnapshot", *flag, env=env)
    assert code == 0, err
    assert differences(expected, restored(tmp_path / "back" / NAME)) == []


# ------------------------------------------------------------------------------------------------
# Two ranks (tests/convert_worker.py)

WORKER = HERE / "convert_worker.py"


@pytest.mark.slow
def test_a_two_rank_snapshot_converts_with_each_ranks_own_values(tmp_path, faulty_local):
    from convert_worker import RESTORE

    saved = launching.run_phase(WORKER, "save", 2, tmp_path)
    target = tmp_path / RESTORE
    ddp, fsdp2_dcp, fsdp2_ts = (tmp_path / name / "epoch_0_step_4" for name in ("ddp_torchsnapshot", "fsdp2_dcp", "fsdp2_torchsnapshot"))
    convert(ddp, target / "ddp_dcp" / "epoch_0_step_4", "dcp")
    convert(target / "ddp_dcp" / "epoch_0_step_4", target / "ddp_rt" / "epoch_0_step_4", "torchsnapshot")
    convert(fsdp2_dcp, target / "fsdp2_ts" / "epoch_0_step_4", "torchsnapshot")
    shutil.copytree(ddp, target / "ddp_src" / "epoch_0_step_4")
    (target / "plan.json").write_text(json.dumps({"ddp_src": "ddp", "ddp_dcp": "ddp", "ddp_rt": "ddp", "fsdp2_ts": "fsdp2"}))
    for name in ("ddp_dcp", "ddp_rt", "fsdp2_ts"):
        index = json.loads((target / name / "epoch_0_step_4" / INDEX).read_text())
        assert index["world_size"] == 2 and len(index["parts"]) == 2

    # the command line reads a two-rank DCP snapshot by the paths of its torchsnapshot original:
    # each rank's own values under its rank, the replicated model once
    code, out, err = run_cli("diff", str(ddp), str(target / "ddp_dcp" / "epoch_0_step_4"))
    assert code == 0 and out.endswith("identical\n") and "added" not in out, (out, err)
    for snapshot in (ddp, target / "ddp_dcp" / "epoch_0_step_4"):
        code, out, _ = run_cli("inspect", str(snapshot), "--json")
        rows = {row["path"]: row for row in json.loads(out)["entries"]}
        assert [rows[f"{r}/tally/note"]["value"] for r in (0, 1)] == ["rank 0", "rank 1"], snapshot
        assert rows["1/tally/rank"]["kind"] == "tensor" and not rows["1/tally/rank"]["replicated"], snapshot
        models = [row for path, row in rows.items() if "/model/" in path]
        assert models and all(row["path"].startswith("0/") and row["replicated"] for row in models), snapshot
    run_cli("export", str(ddp), str(tmp_path / "ts.pt"))
    run_cli("export", str(target / "ddp_dcp" / "epoch_0_step_4"), str(tmp_path / "dcp.pt"))
    exported = [torch.load(tmp_path / name, weights_only=True) for name in ("ts.pt", "dcp.pt")]
    assert exported[0] and differences(*exported) == []

    # torchsnapshot's sharded entries are not read whole by its reader: refused by name
    code, out, err = run_cli("convert", str(fsdp2_ts), str(tmp_path / "refused" / "epoch_0_step_4"), "--to", "dcp")
    assert code == 2 and "without losing entries: 0/model/0.bias" in err and "nothing was written" in err, err
    assert not (tmp_path / "refused").exists()

    # a write of rank 1's failing: nothing committed, nothing left
    (tmp_path / "faulty").mkdir()
    faulty, url = faulty_local(tmp_path / "faulty")
    faulty.inject("write_payload", OSError(5, "Input/output error (injected)"), match=lambda name, rel: rel.startswith("1/"))
    code, out, err = run_cli("convert", str(ddp), f"{url}/epoch_0_step_4", "--to", "dcp")
    assert code == 1 and "Input/output error (injected)" in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path / "faulty") == []

    restored_ranks = launching.run_phase(WORKER, "restore", 2, tmp_path)
    for rank, (save, got) in enumerate(zip(saved, restored_ranks, strict=True)):
        for name, source in (("ddp_src", "ddp_torchsnapshot"), ("ddp_dcp", "ddp_torchsnapshot"),
                             ("ddp_rt", "ddp_torchsnapshot"), ("fsdp2_ts", "fsdp2_dcp")):
            expected, result = save[source]["at_step_4"], got[name]
            assert result["steps"] == 4 and not result["warnings"], (name, result)
            assert result["whole"] == expected["whole"], name
            assert result["rng"] == expected["rng"], name  # each rank's own RNG state
            assert result["tally"] == expected["tally"] == [[rank], f"rank {rank}"], name
    assert saved[0]["ddp_torchsnapshot"]["at_step_4"]["rng"] != saved[1]["ddp_torchsnapshot"]["at_step_4"]["rng"]
