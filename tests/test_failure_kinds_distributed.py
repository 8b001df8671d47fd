"""Under torch.distributed (2 gloo processes, real torchtnt ``train()``): a state one rank cannot
encode stops every rank with UnrestorableStateError at the first snapshot, and a lack of space on
one rank is made up for by deleting early what retention would delete, then writing again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import launching
import pytest

WORKER = Path(__file__).with_name("failure_kinds_worker.py")
WORLD_SIZE = 2

pytestmark = pytest.mark.slow


def run_ranks(scenario: str, out: Path) -> list[dict[str, Any]]:
    return launching.run_scenario(WORKER, scenario, WORLD_SIZE, out)


def test_a_state_one_rank_cannot_encode_stops_every_rank_at_the_first_snapshot(tmp_path):
    records = run_ranks("unencodable", tmp_path)
    for record in records:
        assert record["error"] == "UnrestorableStateError" and record["is_unrestorable"], record
        assert "extra/config" in record["message"], record["message"]
        assert "epoch_0_step_2" in record["message"]
        assert record["steps"] == 2  # the first snapshot, synchronous: training stopped there
        assert record["failed_warnings"] == []
        assert record["dir"] == []  # nothing committed, nothing left behind
    assert "rank 1" in records[0]["message"]  # rank 0 says whose state it is


def test_no_space_on_one_rank_frees_what_retention_would_and_writes_again(tmp_path):
    records = run_ranks("no_space", tmp_path)
    for record in records:
        assert record["committed"] == [2, 4, 6, 8, 10], record
        assert record["failures"] == 0 and record["failed_warnings"] == [], record
        assert record["dir"] == ["epoch_0_step_10", "epoch_0_step_8"]
    # rank 0 deleted step 2 (the oldest; step 4, the newest committed, was spared) before step
    # 6 was written again, and said so once
    assert len(records[0]["space_warnings"]) == 1
    assert "epoch_0_step_2" in records[0]["space_warnings"][0]
    assert "epoch_0_step_4" not in records[0]["space_warnings"][0].split("deleted")[1].split("before")[0]
