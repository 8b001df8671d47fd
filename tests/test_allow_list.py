"""The plugin's additions to torch's weights_only allow-list last only while a restore runs, and
never take away what the user added, before or meanwhile, from any thread."""

from __future__ import annotations

import threading

import torch.serialization as serialization

from tnt_snapshot_plugin.format.objects import allowed_globals, safe_globals


class Mine:
    """A class of the user's, allowed by the user."""


class Theirs:
    """Another, allowed from another thread while a restore runs."""


def test_additions_are_scoped_and_user_entries_survive():
    before = serialization.get_safe_globals()
    serialization.add_safe_globals([Mine])
    try:
        with allowed_globals():
            inside = serialization.get_safe_globals()
            assert all(any(g is h for h in inside) for g in safe_globals())
            added = threading.Thread(target=serialization.add_safe_globals, args=([Theirs],))
            added.start()
            added.join()
            with allowed_globals():  # nested (another restore at once): still allowed after it
                pass
            assert any(g is safe_globals()[0] for g in serialization.get_safe_globals())
        after = serialization.get_safe_globals()
        assert any(g is Mine for g in after) and any(g is Theirs for g in after)
        assert not [g for g in safe_globals() if any(g is h for h in after) and not any(g is b for b in before)]
    finally:
        serialization.clear_safe_globals()
        serialization.add_safe_globals(before)
