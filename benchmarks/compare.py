#!/usr/bin/env python
"""This checkout's plugin against another checkout's, side by side on one machine.

    git worktree add /tmp/base a81544a
    python benchmarks/compare.py /tmp/base --rounds 2 -- --sizes 64MiB 10k --skip checksums

Each round runs this checkout's ``benchmarks/run.py`` twice, in turn (base first in even rounds,
this checkout first in odd ones), the only difference being where ``tnt_snapshot_plugin`` (and its
``adapters``) is imported from. Arguments after ``--`` go to run.py. Every figure of the plugin is
divided by the same figure of a peer measured in the same run (``--peer``, default torch.save),
and the hook costs by a no-op callback's, so what is compared is free of the machine's drift
between runs. The table gives each checkout's ratios, round by round, and the median of this
checkout's over the base's: 1.00x is no change; the rounds' spread is the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
HEAD = HERE.parent

#: Run in the child: the plugin package and its mapped ``adapters`` folder from ROOT, then run.py.
PRELUDE = """
import importlib.util, runpy, sys
root, script = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
import tnt_snapshot_plugin
assert tnt_snapshot_plugin.__file__.startswith(root), tnt_snapshot_plugin.__file__
spec = importlib.util.spec_from_file_location(
    "tnt_snapshot_plugin.adapters", root + "/adapters/__init__.py", submodule_search_locations=[root + "/adapters"])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
tnt_snapshot_plugin.adapters = module
sys.argv = [script] + sys.argv[3:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))
runpy.run_path(script, run_name="__main__")
"""


def run_once(root: Path, args: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-c", PRELUDE, str(root), str(HERE / "run.py"), *args, "--out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=""))
    return json.loads(out.read_text())


def ratios(results: dict[str, Any], peer: str) -> dict[str, float]:
    """Each figure of the plugin's rows over the peer's, keyed "state / row / measure"; hook
    costs over a no-op callback's."""
    out: dict[str, float] = {}
    for size in results.get("sizes", []):
        rows = {r["name"]: r for r in size["methods"] if "error" not in r}
        ref = next((r for name, r in rows.items() if peer in name), None)
        for name, row in rows.items():
            if row.get("peer") or ref is None:
                continue
            for measure in ("stall_s", "durable_s", "restore_s"):
                if row.get(measure) and ref.get(measure):
                    out[f"{size['label']} / {name} / {measure[:-2]} (x {peer})"] = row[measure] / ref[measure]
    for name, hook in (results.get("hooks") or {}).items():
        if "tnt_snapshot_plugin" in name or "plugin" in name:
            out[f"hook / {name} (x no-op)"] = hook.get("ratio", 0.0)
    for name, cand in ((results.get("loop") or {}).get("candidates") or {}).items():
        if "plugin" in name and cand.get("x_noop"):
            out[f"real loop / {name} (x no-op)"] = cand["x_noop"]
    first = results.get("first_stall") or {}
    if "prepared" in first:
        out["first stall / later stalls"] = first["prepared"]["first_over_later"]
    return out


def table(base: list[dict[str, float]], head: list[dict[str, float]]) -> str:
    lines = ["| figure | base, each round | this checkout, each round | this / base (medians) |", "|---|---|---|---:|"]
    for key in base[0]:
        b = [r[key] for r in base if key in r]
        h = [r[key] for r in head if key in r]
        if not b or not h:
            continue
        lines.append(
            f"| {key} | {' '.join(f'{x:.3g}' for x in b)} | {' '.join(f'{x:.3g}' for x in h)} "
            f"| {median(h) / median(b):.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="the other checkout (a git worktree)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peer", default="torch.save", help="the peer row each figure is divided by")
    parser.add_argument("--out", type=Path, help="write every run's results here (JSON)")
    args = parser.parse_args(mine)
    base_root = args.base.resolve()
    runs: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
    with tempfile.TemporaryDirectory(prefix="tnt_compare_") as tmp:
        for round_ in range(args.rounds):
            order = [("base", base_root), ("head", HEAD)]
            for label, root in order if round_ % 2 == 0 else order[::-1]:
                print(f"round {round_ + 1}: {label} ({root})", file=sys.stderr, flush=True)
                runs[label].append(run_once(root, rest, Path(tmp) / f"{label}{round_}.json"))
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    print(table([ratios(r, args.peer) for r in runs["base"]], [ratios(r, args.peer) for r in runs["head"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
