"""The one project name used for pluggy's markers, the plugin manager and the entry-point group."""

PROJECT_NAME = "tnt_snapshot_plugin"
