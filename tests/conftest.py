"""Shared fixtures. Test helpers live in tests/toy.py (importable as ``toy``)."""

from __future__ import annotations

import pytest

from tnt_snapshot_plugin.plugins import new_plugin_manager


@pytest.fixture
def pm():
    """A fresh plugin manager with no entry points loaded: tests register tiny plugins on it."""
    return new_plugin_manager(load_entrypoints=False)
