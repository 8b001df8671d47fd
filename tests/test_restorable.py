"""Every committed snapshot can be restored; loading a snapshot runs no code it carries.

torch 2.13 loads objects with ``weights_only=True``: the saver checks that what it writes loads
so (UnrestorableStateError at the first snapshot otherwise), restore allows common safe types
(loading.safe_globals), and ``weights_only=False`` is the explicit opt-in to full pickle.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import enum
import json
import os

import numpy as np
import pytest
import torch

from tnt_snapshot_plugin import SnapshotFailedWarning, UnrestorableStateError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format.objects import safe_globals
from tnt_snapshot_plugin.restoring import latest_snapshot
from toy import Holder, ToyUnit, train_toy


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class RunConfig:
    lr: float
    name: str


class HoldingUnit(ToyUnit):
    def __init__(self, state: object) -> None:
        super().__init__()
        self.extra = Holder(state)


def _common_state() -> dict:
    return {
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "int_scalar": np.int64(7),
        "float_scalar": np.float64(0.25),
        "dtype": np.dtype("int16"),
        "when": datetime.datetime(2026, 12, 1, 12, 30, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2026, 12, 1),
        "elapsed": datetime.timedelta(seconds=90),
        "args": argparse.Namespace(lr=0.1, layers=[2, 3], name="run"),
        "counts": collections.Counter("aab"),
        "ids": frozenset({1, 2}),
    }


def _train(unit: ToyUnit, dirpath: str, **saver_args) -> ToyUnit:
    return train_toy(dirpath, unit, 2, save_every_n_train_steps=2, **saver_args)


def test_common_types_restore_by_default(tmp_path):
    dirpath = str(tmp_path / "run")
    allowed_before = set(torch.serialization.get_safe_globals())
    _train(HoldingUnit(_common_state()), dirpath)

    fresh = HoldingUnit(None)
    assert TorchSnapshotSaver.restore_from_latest(dirpath, fresh)
    restored = fresh.extra.state
    expected = _common_state()
    assert restored.keys() == expected.keys()
    assert isinstance(restored["array"], np.ndarray)
    np.testing.assert_array_equal(restored["array"], expected["array"])
    for key in expected:
        if key != "array":
            assert restored[key] == expected[key], key
            assert type(restored[key]) is type(expected[key]), key
    # The allow-list is the plugin's only while it restores: torch's own list is left as it was.
    after = torch.serialization.get_safe_globals()
    assert allowed_before <= set(after)
    assert not [g for g in safe_globals() if any(g is a for a in after)]


@pytest.mark.parametrize(
    "value",
    [Color.BLUE, RunConfig(lr=0.5, name="x"), collections.deque([1.0], maxlen=3)],
    ids=["enum", "dataclass", "deque"],
)
def test_unloadable_type_fails_the_first_snapshot_loudly(tmp_path, value):
    dirpath = str(tmp_path / "run")
    unit = HoldingUnit({"nested": [1, {"setting": value}]})
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    # "warn" is the default: this must raise all the same, and commit nothing.
    with pytest.raises(UnrestorableStateError) as info:
        _train(unit, dirpath)
    message = str(info.value)
    assert "extra/nested/1/setting" in message and kind in message
    assert "add_safe_globals" in message and "weights_only=False" in message
    assert latest_snapshot(dirpath) is None

    if isinstance(value, collections.deque):
        return  # torch's weights_only unpickler cannot build one, allowed or not
    # Allowed by the user, the same state saves and restores.
    with torch.serialization.safe_globals([type(value)]):
        _train(HoldingUnit({"nested": [1, {"setting": value}]}), str(tmp_path / "allowed"))
        fresh = HoldingUnit(None)
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "allowed"), fresh)
    assert fresh.extra.state["nested"][1]["setting"] == value


def test_weights_only_false_is_an_explicit_opt_in(tmp_path, recwarn):
    dirpath = str(tmp_path / "run")
    _train(HoldingUnit({"color": Color.RED}), dirpath, weights_only=False)
    newest = latest_snapshot(dirpath)
    assert newest is not None

    # The default restore refuses it with a message saying what to do; it is not "damaged".
    with pytest.raises(UnrestorableStateError, match="Color") as info:
        TorchSnapshotSaver.restore(newest, HoldingUnit(None))
    assert "weights_only=False" in str(info.value)
    with pytest.raises(UnrestorableStateError):
        TorchSnapshotSaver.restore_from_latest(dirpath, HoldingUnit(None))

    fresh = HoldingUnit(None)
    assert TorchSnapshotSaver.restore_from_latest(dirpath, fresh, weights_only=False)
    assert fresh.extra.state == {"color": Color.RED}
    assert not [w for w in recwarn.list if issubclass(w.category, SnapshotFailedWarning)]


class _Planted:
    """Unpickled with full pickle, this creates the marker (a directory)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_planted_pickle_is_refused_by_default(tmp_path):
    dirpath = str(tmp_path / "run")
    _train(HoldingUnit({"args": argparse.Namespace(lr=0.1)}), dirpath)
    newest = latest_snapshot(dirpath)
    assert newest is not None
    manifest = json.loads((tmp_path / "run" / os.path.basename(newest) / ".snapshot_metadata").read_text())[
        "manifest"
    ]
    [location] = [e["location"] for p, e in manifest.items() if e["type"] == "object" and "/extra/" in p]
    marker = tmp_path / "marker"
    torch.save(_Planted(str(marker)), os.path.join(newest, location))
    # The plant alone is caught by the checksum as damage; a planter rewrites the index too.
    from tnt_snapshot_plugin.format.checksums import record_views
    from tnt_snapshot_plugin.format.index import seal as seal_index

    index_path = os.path.join(newest, ".tnt_snapshot_index.json")
    with open(index_path) as f:
        index = json.load(f)
    with open(os.path.join(newest, location), "rb") as f:
        planted = f.read()
    index["checksums"][location] = record_views([memoryview(planted)])
    index["files"][location] = len(planted)
    del index["seal"]
    with open(index_path, "wb") as f:
        f.write(seal_index(index))  # sealed again: the seal is integrity, not authenticity

    with pytest.raises(UnrestorableStateError, match="mkdir"):
        TorchSnapshotSaver.restore(newest, HoldingUnit(None))
    assert not marker.exists()
    # The plant is live: full pickle (the opt-in, for trusted snapshots only) would run it.
    TorchSnapshotSaver.restore(newest, HoldingUnit(None), weights_only=False)
    assert marker.exists()
