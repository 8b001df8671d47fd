"""Stores as plugins (stores/registry.py) and the declared dependencies.

* A URL scheme chooses its store: registered (the built-in local and S3 stores are, as setup.cfg
  declares them), declared by an installed distribution in the entry-point group
  ``tnt_snapshot_plugin.stores`` (a real distribution on a temporary ``sys.path`` entry, read by
  a fresh interpreter), or served through fsspec. Clobbering a scheme is refused; an unknown
  scheme names itself and what to install.
* fsspec, boto3 and gcsfs are imported only when a URL that needs them is opened, and their
  absence is a ConfigError with the ``pip install`` command.
* What setup.cfg declares is what the package imports.
"""

from __future__ import annotations

import ast
import configparser
import re
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points, packages_distributions
from pathlib import Path

import pytest

from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.stores import LocalStore, Store, open_store
from tnt_snapshot_plugin.stores import registry as store_registry
from tnt_snapshot_plugin.stores.registry import (
    BUILTIN_STORES,
    ENTRY_POINT_GROUP,
    register_store,
    registered_schemes,
    unregister_store,
)
from tnt_snapshot_plugin.testing import MemoryStore

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, *, path: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter (``path`` first on sys.path); its stdout."""
    env = None
    if path is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


# ------------------------------------------------------------------------------------------------
# The registry


def test_the_builtin_stores_are_registered_as_setup_cfg_declares_them():
    declared = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert {scheme: target for scheme, target in BUILTIN_STORES} == {
        scheme: declared[scheme] for scheme in ("file", "s3")
    }
    assert registered_schemes()["file"] == "tnt_snapshot_plugin.stores.local:open_local"
    assert isinstance(open_store("relative/run"), LocalStore)
    assert open_store("file:///tmp/run").root == "/tmp/run"


def test_a_registration_never_clobbers_a_scheme(tmp_path):
    made: list[str] = []

    def opener(url, storage_options, timeout_s):
        made.append(url)
        return MemoryStore(url)

    try:
        register_store("unit-test", opener)
        register_store("unit-test", opener)  # the same again: harmless
        assert isinstance(open_store("unit-test://a"), MemoryStore) and made == ["unit-test://a"]
        with pytest.raises(ConfigError, match=r"'unit-test' is already served by .*refusing to replace it"):
            register_store("unit-test", "somewhere:else")
        with pytest.raises(ConfigError, match=r"'file' is already served by tnt_snapshot_plugin\.stores\.local"):
            register_store("file", opener)
        register_store("unit-test", "tnt_snapshot_plugin.stores.local:open_local", clobber=True)
        assert isinstance(open_store("unit-test://a"), LocalStore)  # the new opener, by its dotted path
        assert made == ["unit-test://a"]
    finally:
        unregister_store("unit-test")
    assert isinstance(open_store(str(tmp_path)), LocalStore)
    for bad in ("S3", "1x", "a b", ""):
        with pytest.raises(ConfigError, match="URL scheme"):
            register_store(bad, opener)
    with pytest.raises(ConfigError, match="module:attribute"):
        register_store("nocolon", "just.a.module")


def test_an_opener_that_cannot_be_loaded_is_a_config_error():
    try:
        register_store("broken", "tnt_snapshot_plugin.stores.no_such_module:open")
        with pytest.raises(ConfigError, match=r"the store for broken:// .* cannot be loaded .*reinstall"):
            open_store("broken://x")
    finally:
        unregister_store("broken")


def test_an_unknown_scheme_names_itself_and_what_to_install():
    with pytest.raises(ConfigError) as caught:
        open_store("nosuchfs://bucket/run")
    message = str(caught.value)
    assert "'nosuchfs'" in message and "does not support" in message
    assert "pip install 'tnt-snapshot-plugin[fsspec]'" in message and ENTRY_POINT_GROUP in message


def _write_distribution(site: Path, entry_points_txt: str) -> None:
    """A real installed distribution ``my-store 1.0`` (module ``my_store``) in ``site``."""
    (site / "my_store.py").write_text(
        textwrap.dedent(
            """
            from tnt_snapshot_plugin.testing import MemoryStore

            def open_mine(url, storage_options, timeout_s):
                store = MemoryStore(url)
                store.options = storage_options
                return store
            """
        )
    )
    info = site / "my_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points_txt)


def test_an_installed_distribution_adds_a_scheme_through_the_entry_point_group(tmp_path):
    _write_distribution(tmp_path, f"[{ENTRY_POINT_GROUP}]\nmine = my_store:open_mine\n")
    out = run_python(
        """
        import sys
        from tnt_snapshot_plugin.stores import open_store, registered_schemes
        store = open_store("mine://bucket/run", {"token": "t"})
        print(type(store).__name__, store.url, store.options, registered_schemes()["mine"])
        print("my_store" in sys.modules)
        """,
        path=tmp_path,
    )
    assert out.splitlines() == ["MemoryStore mine://bucket/run {'token': 't'} my_store:open_mine", "True"]


def test_an_entry_point_that_would_clobber_a_builtin_scheme_is_refused(tmp_path):
    _write_distribution(tmp_path, f"[{ENTRY_POINT_GROUP}]\ns3 = my_store:open_mine\n")
    out = run_python(
        """
        from tnt_snapshot_plugin.errors import ConfigError
        from tnt_snapshot_plugin.stores import open_store
        try:
            open_store("unclaimed://x")
        except ConfigError as exc:
            print(exc)
        """,
        path=tmp_path,
    )
    assert "my-store declares the store my_store:open_mine for the URL scheme 's3'" in out
    assert "tnt_snapshot_plugin.stores.s3:open_s3 already serves; uninstall one of them" in out


# ------------------------------------------------------------------------------------------------
# Imported only when needed


def test_local_snapshots_import_neither_fsspec_nor_boto3(tmp_path):
    out = run_python(
        f"""
        import sys
        import torch
        from tnt_snapshot_plugin.config import SnapshotConfig
        from tnt_snapshot_plugin.restoring import restore_from_latest
        from tnt_snapshot_plugin.saving.saver import Snapshotter
        saver = Snapshotter({str(tmp_path / "run")!r}, SnapshotConfig.build(async_snapshot=False, preemption_signals=[]))
        saver.train_start(["m"])
        saver.train_end(0, 1, lambda intra: {{"m": torch.nn.Linear(2, 2)}})
        print(sorted(m for m in ("fsspec", "boto3", "botocore", "s3fs") if m in sys.modules))
        from tnt_snapshot_plugin.stores import open_store
        open_store("memory://imported-now")
        print("fsspec" in sys.modules)
        """
    )
    assert out.splitlines() == ["[]", "True"]
    assert (tmp_path / "run" / "epoch_0_step_1" / ".snapshot_metadata").is_file()


def test_without_fsspec_an_fsspec_url_says_what_to_install():
    out = run_python(
        """
        import sys
        sys.modules["fsspec"] = None  # as if it were not installed
        from tnt_snapshot_plugin.errors import ConfigError
        from tnt_snapshot_plugin.stores import open_store
        try:
            open_store("memory://run")
        except ConfigError as exc:
            print(exc)
        from tnt_snapshot_plugin.stores.fsspec import FsspecStore
        try:
            FsspecStore("gs://bucket/run")
        except ConfigError as exc:
            print(exc)
        print(type(open_store("local/run")).__name__)
        """
    )
    unsupported, direct, local = out.splitlines()
    assert "storage protocol 'memory'" in unsupported and "pip install 'tnt-snapshot-plugin[fsspec]'" in unsupported
    assert direct == (
        "dirpath 'gs://bucket/run' is served through fsspec, which is not installed: "
        "pip install 'tnt-snapshot-plugin[fsspec]'"
    )
    assert local == "LocalStore"


def test_without_gcsfs_a_gs_url_says_what_to_install():
    out = run_python(
        """
        import sys
        sys.modules["gcsfs"] = None  # as if it were not installed
        from tnt_snapshot_plugin.errors import ConfigError
        from tnt_snapshot_plugin.stores import open_store
        try:
            open_store("gs://bucket/run")
        except ConfigError as exc:
            print(exc)
        """
    )
    assert out.startswith("dirpath 'gs://bucket/run': fsspec's implementation of gs:// is not installed")
    assert out.endswith("pip install 'tnt-snapshot-plugin[gcs]'")


def test_the_fakes_are_not_reachable_through_the_default_registry():
    out = run_python(
        """
        from tnt_snapshot_plugin.errors import ConfigError
        from tnt_snapshot_plugin.stores import open_store
        try:
            open_store("fake://run")
        except ConfigError as exc:
            print("refused:", "'fake'" in str(exc))
        print(type(open_store("memory://run")).__name__)
        from tnt_snapshot_plugin.testing import MemoryStore, register
        register("run", MemoryStore())
        print(type(open_store("fake://run")).__name__)
        """
    )
    assert out.splitlines() == ["refused: True", "FsspecStore", "MemoryStore"]


# ------------------------------------------------------------------------------------------------
# Declared dependencies = imported dependencies


def _requirements(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower().replace("_", "-"))
    return names


def _declared() -> tuple[set[str], set[str]]:
    """(the base requirements, every extra's) of setup.cfg, as normalised distribution names."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    base = _requirements(cfg["options"]["install_requires"])
    extras = set().union(*(_requirements(v) for v in cfg["options.extras_require"].values()))
    return base, extras


def _imported_distributions(folder: Path) -> dict[str, set[str]]:
    """Distribution -> the files under ``folder`` that import one of its modules (any depth)."""
    to_dist = packages_distributions()
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "tnt_snapshot_plugin":
                    continue
                for dist in to_dist.get(top, [top]):
                    found.setdefault(dist.lower().replace("_", "-"), set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_base_requirement_is_imported_by_the_package():
    base, _ = _declared()
    imported = _imported_distributions(ROOT / "tnt_snapshot_plugin")
    assert base == {"torch", "numpy", "pluggy", "xxhash"}
    assert base <= set(imported), f"declared and never imported: {sorted(base - set(imported))}"


def test_every_import_of_the_package_and_its_adapters_is_declared():
    base, extras = _declared()
    imported = {**_imported_distributions(ROOT / "adapters"), **_imported_distributions(ROOT / "tnt_snapshot_plugin")}
    undeclared = {dist: sorted(files) for dist, files in imported.items() if dist not in base | extras}
    assert not undeclared, f"imported and not declared in setup.cfg: {undeclared}"
    assert "torchsnapshot-nightly" not in base and "torchsnapshot-nightly" not in imported
    assert "fsspec" not in base and "fsspec" in imported  # an extra: imported for fsspec URLs only


def test_the_extras_hold_what_their_names_enable():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = {name: _requirements(value) for name, value in cfg["options.extras_require"].items()}
    assert {"torchtnt", "torchsnapshot-nightly"} <= extras["torchtnt"]  # torchtnt's own saver needs it
    assert "torchsnapshot-nightly" in extras["test"] and "torchsnapshot-nightly" not in extras["lightning"]
    assert extras["fsspec"] == {"fsspec"} and "gcsfs" in extras["gcs"] and "adlfs" in extras["azure"]
    assert {"boto3", "botocore"} <= extras["s3"]
    everything_tested = set().union(*(extras[n] for n in ("torchtnt", "lightning", "s3", "fsspec", "cli", "test")))
    assert everything_tested <= extras["all"], sorted(everything_tested - extras["all"])
    assert {"s3fs", "moto"} <= extras["all"]


def test_the_store_modules_say_their_job():
    for path in [*sorted((ROOT / "tnt_snapshot_plugin" / "stores").glob("*.py")), ROOT / "tnt_snapshot_plugin" / "testing.py",
                 ]:
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.name} has no docstring"


def test_store_is_the_type_every_opener_returns():
    assert all(isinstance(open_store(url), Store) for url in ("local/run", "memory://typed"))
    assert store_registry.opener_for("memory") is store_registry.opener_for("memory")
