"""The plugin's work-arounds for torchsnapshot bugs, each shown against real torchsnapshot."""

from __future__ import annotations

import random

from tnt_snapshot_plugin.app_state import RNGState
from tnt_snapshot_plugin.compat import Snapshot


def test_torchsnapshot_no_longer_draws_from_the_global_python_rng(tmp_path):
    # Unpatched, every take/restore called random.randint on the global generator, so a
    # snapshot changed the training's random stream (and an async one did so at a random moment).
    random.seed(3)
    before = random.getstate()
    Snapshot.take(str(tmp_path / "snap"), {"rng": RNGState()})
    assert random.getstate() == before

    random.seed(99)
    Snapshot(str(tmp_path / "snap")).restore({"rng": RNGState()})
    assert random.getstate() == before
