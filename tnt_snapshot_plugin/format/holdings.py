"""What a snapshot directory holds, in words: the part of an error message that tells a user where
to look next ("... does not exist; run1 holds 3 complete snapshots, the newest epoch_2_step_10").

Restore and the ``tnt-snapshot`` command say it the same way, from the same listing the saver's
retention and ``restore_from_latest`` use (:meth:`Store.complete_snapshots`, commit order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tnt_snapshot_plugin.format import listing

if TYPE_CHECKING:
    from tnt_snapshot_plugin.stores import Store

#: How many snapshot names a message lists before "...".
SHOWN = 5


def complete_names(store: Store) -> list[str]:
    """The complete snapshots in ``store``'s directory, oldest first in commit order; [] when
    the directory cannot be listed (missing, not a directory, unreachable)."""
    try:
        return [s.text for s in listing.complete_snapshots(store)]
    except Exception:  # a message about another problem must not fail on this one
        return []


def describe(store: Store) -> str:
    """``"DIR holds 3 complete snapshots: a, b, c (the newest c)"``, or ``"DIR holds no
    complete snapshot"``."""
    names = complete_names(store)
    if not names:
        return f"{store.url} holds no complete snapshot"
    if len(names) == 1:
        return f"{store.url} holds one complete snapshot, {names[0]}"
    shown = names[-SHOWN:]
    more = "..., " if len(names) > SHOWN else ""
    return f"{store.url} holds {len(names)} complete snapshots: {more}{', '.join(shown)} (the newest {names[-1]})"
