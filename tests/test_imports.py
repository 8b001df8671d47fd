"""The package's import graph: no cycles, and nothing imports a layer above its own; and the
public API: every exported name imports, and importing the package imports neither torch nor a
framework.

Every import that runs counts, those inside functions too; those under ``if TYPE_CHECKING:``
never run and do not. The layers, from the top: the adapters, the
command line, the demo and the fakes for tests; the save and restore paths (``saving``,
``restoring``); the format, the stores and the policies; the values everything shares (errors,
configuration, names, hooks, the application state's entries, the collectives). A module imports
its own layer or those below it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"tnt_snapshot_plugin": ROOT / "tnt_snapshot_plugin", "tnt_snapshot_plugin.adapters": ROOT / "adapters"}

#: The layer of each top-level part, highest first (a module's layer is its first part's).
LAYERS = [
    {"adapters", "cli", "demo", "__main__", "testing"},
    {"saving", "restoring"},
    {"format", "stores", "policies"},
    {"errors", "config", "naming", "hookspecs", "hooks", "app_state", "distributed", "metrics", "demo_data"},
]


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if package == "tnt_snapshot_plugin" and parts[0] == "adapters":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (a package's __init__ only when it is imported for
    itself, not for a submodule of it)."""
    is_package = path.name == "__init__.py"
    base = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # imports for the type checker only: never run
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            submodules = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in known]
            if submodules:
                found.update(submodules)
                if len(submodules) < len(node.names) and module in known:
                    found.add(module)
            elif module in known:
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
    found.discard(name)
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    first = "adapters" if parts[1:2] == ["adapters"] else (parts[1] if len(parts) > 1 else "")
    if not first:
        return 0  # the package itself: its public API, at the top
    for index, group in enumerate(LAYERS):
        if first in group:
            return index
    raise AssertionError(f"{name}: no layer")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward(edges: dict[str, set[str]]) -> list[str]:
    return [
        f"{name} -> {dep}"
        for name, deps in sorted(edges.items())
        for dep in sorted(deps)
        if layer(name) != 0 and layer(dep) < layer(name)
    ]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_nothing_imports_a_layer_above_its_own():
    assert upward(graph()) == []


def test_the_walk_sees_imports_inside_functions_and_cycles_through_them():
    """The graph is the one the tests above judge: a function-level import is an edge, and a
    cycle made only of such edges is found."""
    edges = graph()
    # the registry imports stores/fsspec.py inside opener_for only
    assert "tnt_snapshot_plugin.stores.fsspec" in edges["tnt_snapshot_plugin.stores.registry"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert upward({"tnt_snapshot_plugin.config": {"tnt_snapshot_plugin.policies"}}) == [
        "tnt_snapshot_plugin.config -> tnt_snapshot_plugin.policies"
    ]


def test_every_public_name_imports_and_the_package_imports_neither_torch_nor_a_framework():
    code = (
        "import sys\n"
        "import tnt_snapshot_plugin as p\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'torchtnt', 'pytorch_lightning', 'lightning', "
        "'torchsnapshot') if m in sys.modules)\n"
        "print(heavy)\n"
        "missing = [n for n in p.__all__ if getattr(p, n, None) is None]\n"
        "print(missing, len(p.__all__) == len(set(p.__all__)))\n"
        "print(sorted(m for m in ('torchtnt', 'pytorch_lightning', 'lightning') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[] True", "[]"]


def test_the_public_api_holds_what_users_import():
    import tnt_snapshot_plugin as p
    from tnt_snapshot_plugin import errors, policies, restoring, stores
    from tnt_snapshot_plugin.format import base, registry
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    assert p.Snapshotter is Snapshotter
    assert (p.RestoreRequest, p.restore, p.restore_from_latest) == (
        restoring.RestoreRequest, restoring.restore, restoring.restore_from_latest
    )
    assert (p.latest_snapshot, p.best_snapshot) == (restoring.latest_snapshot, restoring.best_snapshot)
    assert (p.Store, p.open_store) == (stores.Store, stores.open_store)
    assert (p.Format, p.register_format) == (base.Format, registry.register_format)
    assert p.testing.MemoryStore is not None and p.PROJECT_NAME == "tnt_snapshot_plugin"
    for name in policies.__all__:
        if name[0].isupper() and name not in ("MODES", "Listed", "PluginDecision"):
            assert getattr(p, name) is getattr(policies, name), name
    for name, value in vars(errors).items():
        if isinstance(value, type) and issubclass(value, (errors.SnapshotError, errors.SnapshotWarning)):
            assert name in p.__all__ and getattr(p, name) is value, name


if __name__ == "__main__":
    g = graph()
    for c in cycles(g):
        print("CYCLE", c)
    for name, deps in sorted(g.items()):
        for dep in sorted(deps):
            if layer(name) != 0 and layer(dep) < layer(name):
                print("UP", name, "->", dep)
