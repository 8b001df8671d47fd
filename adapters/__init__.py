"""Framework adapters; installed as ``tnt_snapshot_plugin.adapters`` (never as ``adapters``).

Each adapter is a pluggy plugin registered through the ``tnt_snapshot_plugin`` entry-point group,
exactly like a third-party plugin, and is blocked (never registered) when its framework is missing.
"""
