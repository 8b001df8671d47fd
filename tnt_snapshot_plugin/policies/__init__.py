"""Policies: when to take a snapshot, and which committed snapshots to keep.

Both kinds are small objects combined with "any", so the configured cadences and users' own
policies mix freely (``SnapshotConfig.build(save_policies=..., preservation_policies=...)``, the
adapters' ``save_policies`` / ``preservation_policies``).

* :mod:`.save`: save decisions, :meth:`SavePolicy.should_save` at a :class:`Moment`
  (``EveryNSteps``, ``EveryNEpochs``, ``EveryNEvalEpochs``, ``EveryNSeconds``, ``AnySave``), and
  the plugins' last word (:class:`PluginDecision`);
* :mod:`.preservation`: which of the plugin's snapshots to keep, :meth:`PreservationPolicy.keep`
  (``LatestN``, ``BestN``, ``KeepEveryNSteps``, ``KeepOnePerNHours``, ``AnyPreservation``);
* :mod:`.retention`: commit order ("latest"), ranking by a metric, and what may ever be deleted;
* :mod:`.retaining`: ``Retention``, which applies them to one saver's directory (imported from
  there: it reads the directory through the format's listing).
"""

from __future__ import annotations

from tnt_snapshot_plugin.config import MODES, Best
from tnt_snapshot_plugin.policies.preservation import (
    AnyPreservation,
    BestN,
    KeepEveryNSteps,
    KeepOnePerNHours,
    LatestN,
    PreservationPolicy,
    from_settings,
    preservation,
    to_delete,
)
from tnt_snapshot_plugin.policies.retention import Listed, commit_order
from tnt_snapshot_plugin.policies.save import (
    AnySave,
    EveryNEpochs,
    EveryNEvalEpochs,
    EveryNSeconds,
    EveryNSteps,
    Moment,
    PluginDecision,
    SavePolicy,
    save_policies,
)

__all__ = [
    "MODES",
    "AnyPreservation",
    "AnySave",
    "Best",
    "BestN",
    "EveryNEpochs",
    "EveryNEvalEpochs",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepEveryNSteps",
    "KeepOnePerNHours",
    "LatestN",
    "Listed",
    "Moment",
    "PluginDecision",
    "PreservationPolicy",
    "SavePolicy",
    "commit_order",
    "from_settings",
    "preservation",
    "save_policies",
    "to_delete",
]
