"""Shared fixtures. Test helpers live in tests/toy.py (importable as ``toy``)."""

from __future__ import annotations

import pytest

from tnt_snapshot_plugin.hooks import new_plugin_manager


@pytest.fixture
def pm():
    """A fresh plugin manager with no entry points loaded: tests register tiny plugins on it."""
    return new_plugin_manager(load_entrypoints=False)


@pytest.fixture
def faulty_local():
    """``faulty_local(path) -> (faulty, dirpath)``: a FaultyStore around a real LocalStore at
    ``path``, registered under a fresh ``fake://`` name (forgotten after the test), so real
    savers and restores opened on ``dirpath`` write to and read from the real disk at ``path``
    through faults and hooks the test chooses."""
    import uuid

    from tnt_snapshot_plugin.stores import LocalStore
    from tnt_snapshot_plugin.testing import FaultyStore, register, unregister

    names: list[str] = []

    def make(path):
        faulty = FaultyStore(LocalStore(str(path)))
        names.append(f"local-{uuid.uuid4().hex[:12]}")
        return faulty, register(names[-1], faulty)

    yield make
    for name in names:
        unregister(name)
