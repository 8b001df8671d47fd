"""tnt_snapshot_plugin.saving."""
