"""The built-in adapters as pluggy plugins, published under the ``tnt_snapshot_plugin`` entry-point
group like any third-party plugin. They name their classes by dotted path, so loading them
imports no framework; :mod:`tnt_snapshot_plugin.hooks` blocks each one whose framework is missing.
Which framework each adapter needs, and how to install it, is said here only.
"""

from __future__ import annotations

from tnt_snapshot_plugin.hooks import AdapterInfo, hookimpl


class TorchtntAdapterPlugin:
    @hookimpl
    def tnt_snapshot_plugin_adapters(self) -> AdapterInfo:
        return AdapterInfo(
            name="torchtnt",
            framework="torchtnt",
            install="pip install 'tnt-snapshot-plugin[torchtnt]'",
            saver="tnt_snapshot_plugin.adapters.torchtnt:TorchSnapshotSaver",
            demo="tnt_snapshot_plugin.adapters.torchtnt.demo:demo",
        )


class LightningAdapterPlugin:
    @hookimpl
    def tnt_snapshot_plugin_adapters(self) -> AdapterInfo:
        return AdapterInfo(
            name="lightning",
            framework="pytorch_lightning",
            install="pip install 'tnt-snapshot-plugin[lightning]'",
            saver="tnt_snapshot_plugin.adapters.lightning:TorchSnapshotSaver",
            demo="tnt_snapshot_plugin.adapters.lightning.demo:demo",
        )


torchtnt = TorchtntAdapterPlugin()
lightning = LightningAdapterPlugin()
