"""The benchmark runs end to end: every method, every floor, the table and the JSON.

It runs in --smoke mode: every part of the run on the least work (two tiny states, one timed
repetition, a few loop steps), so the test's time follows the work it does, however busy the
machine. No timing is asserted (figures on a shared machine are noise); only that everything was
measured, every method restored exactly what it saved, and the report names every row.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
#: Only against a hang: a smoke run takes a minute or two, several times that on a loaded machine.
HANG_S = 3600

METHODS = [
    "tnt_snapshot_plugin async",
    "tnt_snapshot_plugin sync",
    "tnt_snapshot_plugin (dcp) async",
    "torchtnt TorchSnapshotSaver async",
    "torchtnt TorchSnapshotSaver sync",
    "torchsnapshot Snapshot.async_take",
    "torchsnapshot Snapshot.take",
    "torch.save / torch.load(mmap=True)",
    "torch.distributed.checkpoint async_save",
    "torch.distributed.checkpoint async_save (PROCESS)",
    "torch.distributed.checkpoint async_save + DefaultStager",
    "torch.distributed.checkpoint save",
    "torchtnt DistributedCheckpointSaver async",
    "Lightning save_checkpoint + AsyncCheckpointIO",
    "Lightning ModelCheckpoint (save_checkpoint)",
]

SDW_METHODS = [
    "tnt_snapshot_plugin (thread writer)",
    "tnt_snapshot_plugin (process writer)",
    "torch.distributed.checkpoint async_save (thread)",
    "torch.distributed.checkpoint async_save (PROCESS)",
    "torchtnt TorchSnapshotSaver async",
    "torchtnt DistributedCheckpointSaver async",
    "Lightning AsyncCheckpointIO",
]


@pytest.mark.slow
def test_smoke_benchmark_produces_the_table_and_the_json(tmp_path):
    out = tmp_path / "results.json"
    table_file = tmp_path / "table.md"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out), "--markdown", str(table_file),
         "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_S,
        cwd=BENCHMARK.parent.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    results = json.loads(out.read_text())
    assert results["quick"] is True and results["smoke"] is True
    assert [size["reps"] for size in results["sizes"]] == [1, 1]
    for size in results["sizes"]:
        assert [m["name"] for m in size["methods"]] == METHODS
        for row in size["methods"]:
            assert "error" not in row, row
            assert row["restore_ok"] is True, row["name"]
            for key in ("stall_s", "durable_s", "restore_s"):
                assert row[key] > 0, (row["name"], key)
            assert row["peak_extra_bytes"] >= 0
            assert len(row["stall_samples"]) == size["reps"]
        floors = size["floors"]
        for key in ("copy_s", "disk_write_Bps", "disk_read_Bps", "durable_s", "restore_s"):
            assert floors[key] > 0, key
    hooks = results["hooks"]
    assert set(hooks) == {
        "no-op torchtnt Callback.on_train_step_end",
        "tnt_snapshot_plugin TorchSnapshotSaver.on_train_step_end",
        "tnt_snapshot_plugin TorchSnapshotSaver.on_train_step_end, save_every_n_seconds",
        "tnt_snapshot_plugin Snapshotter.step_end (core)",
        "torchtnt TorchSnapshotSaver.on_train_step_end",
    }
    assert all(v["per_call_ns"] > 0 for v in hooks.values())
    loop = results["loop"]["candidates"]
    assert set(loop) == {
        "no callback", "no-op torchtnt Callback", "torchtnt TorchSnapshotSaver",
        "tnt_snapshot_plugin TorchSnapshotSaver",
    }
    assert all(v["per_step_ns"] > 0 and v["samples"] == 10 for v in loop.values())

    assert set(results["loop_distributed"]["candidates"]) == set(loop)
    two = results["loop_2ranks"]["candidates"]  # benchmarks/agreement.py: 2 gloo ranks
    assert set(two) == set(loop) | {"tnt_snapshot_plugin TorchSnapshotSaver, agreeing at every step (as before)"}
    assert all(v["per_step_ns"] > 0 and v["samples"] == 5 for v in two.values())
    for size in results["sizes"]:  # the checksum cost, on and off, on each quick state
        sums = size["checksums"]
        assert sums["on"]["durable"] > 0 and sums["off"]["restore"] > 0
        assert sums["on"]["hash_write"] > 0 and sums["off"]["hash_write"] == 0
        dcp_sums = size["checksums_dcp"]  # the same in DCP's format (the plugin's DCP row ran)
        assert dcp_sums["format"] == "dcp" and dcp_sums["on"]["durable"] > 0
        assert dcp_sums["on"]["hash_write"] > 0 and dcp_sums["off"]["hash_write"] == 0
    first = results["first_stall"]
    assert len(first["prepared"]["stalls"]) == len(first["not prepared"]["stalls"]) == 1
    # the step time during a write (benchmarks/step_during_write.py): every method, both steps
    sdw = results["step_during_write"]
    assert [c["label"] for c in sdw["configs"]] == ["8 MiB (8 x 1 MiB), 1 rank"]
    (config,) = sdw["configs"]
    assert [m["name"] for m in config["methods"]] == SDW_METHODS
    for row in config["methods"]:
        assert row["built"] is True and "error" not in row and not row.get("errors"), row
        assert set(row["kinds"]) == {"python-heavy", "one-large-op"}, row["name"]
        for kind, v in row["kinds"].items():
            assert "error" not in v, (row["name"], kind, v)
            assert v["quiet_steps"] > 0 and v["writes"] > 0, (row["name"], kind)
            compared = v["in_flight_steps"] if v["basis"] == "in flight" else v["partial_steps"]
            assert compared > 0 and (v["basis"] == "in flight") == (v["in_flight_steps"] > 0), (row["name"], kind)
            assert v["every"] and all(k >= 2 for k in v["every"]), (row["name"], kind)
            for key in ("quiet_median_s", "in_flight_median_s", "quiet_p95_s", "in_flight_p95_s"):
                assert v[key] > 0, (row["name"], kind, key)
            assert v["in_flight_p95_s"] >= v["in_flight_median_s"] and v["quiet_p95_s"] >= v["quiet_median_s"]
            assert v["median_ratio"] == v["in_flight_median_s"] / v["quiet_median_s"]
            assert v["p95_ratio"] == v["in_flight_p95_s"] / v["quiet_p95_s"]
    # every target, with its verdict, in the JSON: per size and for the whole run
    targets = results["targets"]
    assert [t for size in results["sizes"] for t in size["targets"]] == targets[: len(targets) - 5]
    assert {t["scope"] for t in targets[-5:]} == {"hooks", "loop", "loop_distributed", "loop_2ranks", "first stall"}
    assert all(t["value"] is not None and t["met"] in (True, False, None) for t in targets), targets
    small = [t["target"] for t in results["sizes"][1]["targets"]]
    assert "async: stall / (state_dict() + 1.5x copy floor)" in small
    assert "checksums: added restore time / restore without" in small
    # the plugin's DCP row is held to its own targets, against the fastest stock DCP row
    for size in results["sizes"]:
        dcp = [t for t in size["targets"] if t["target"].startswith("dcp format")]
        assert [t["target"] for t in dcp if "stock DCP" in t["target"]] == [
            "dcp format, async: durable / fastest stock DCP row",
            "dcp format, async: restore / fastest stock DCP row",
        ], dcp
        assert all(t["value"] is not None for t in dcp), dcp
        # ... and not to the torchsnapshot rows' (one async row of those: one async stall target)
        assert sum(t["target"].startswith("async: stall") for t in size["targets"]) == 1

    table = table_file.read_text()
    assert table in proc.stdout  # printed too
    assert table.count("### Step time during a write") == 1
    before, sdw_part = table.split("### Step time during a write")
    rows = before.splitlines()
    for name in METHODS:  # one row per state size
        assert sum(r.startswith((f"| {name} |", f"| **{name}** |")) for r in rows) == 2, name
    for floor in ("copy into preallocated buffers", "disk sequential write + fsync", "disk cold sequential read"):
        assert table.count(floor) == 2, floor
    assert "×best peer" in table and "×floor" in table
    assert "### Hook cost" in table and "### First snapshot stall" in table
    assert "#### 8 MiB (8 x 1 MiB), 1 rank" in sdw_part
    sdw_rows = sdw_part.splitlines()
    for name in SDW_METHODS:  # a row per step kind, with both ratios
        mine = [r for r in sdw_rows if r.startswith((f"| {name} |", f"| **{name}** |"))]
        assert [r.split(" | ")[1] for r in mine] == ["python-heavy", "one-large-op"], mine
        assert all(r.count("x |") == 2 for r in mine), mine
    for size in results["sizes"]:
        assert f"targets at {size['label']}" in table
    assert "targets measured once per run" in table and "targets met" in table
    # the scratch directory was cleaned up: no snapshot left behind
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "table.md"}
