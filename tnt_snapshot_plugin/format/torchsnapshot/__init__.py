"""tnt_snapshot_plugin.format.torchsnapshot."""
