"""The demo command: ``tnt-snapshot-demo`` (or ``python -m tnt_snapshot_plugin``).

Trains a small model with the chosen framework into a local directory, crashes it on purpose,
resumes from the latest complete snapshot in a fresh model, and prints what was saved and
restored, with timings, and whether the resumed run ends bitwise equal to an uninterrupted one.
The directory must be new, empty, or an earlier demo's (its marker file ``.tnt_snapshot_demo``):
the demo deletes its earlier snapshots before each run, and refuses any other directory.
The framework's demo comes from its adapter plugin, found through the plugin manager.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any, Optional, Sequence

from tnt_snapshot_plugin.hooks import adapters
from tnt_snapshot_plugin.naming import SnapshotName, is_staging_name
from tnt_snapshot_plugin.stores import LOCK_FNAME

DEFAULT_DIRPATH = "./demo-snapshots"
#: Written into a directory the demo uses: the mark that its snapshots are the demo's own.
DEMO_MARKER = ".tnt_snapshot_demo"


def _refusal(dirpath: str) -> Optional[str]:
    """Why the demo must not use ``dirpath`` (None: it may). The demo deletes its earlier
    snapshots before each run, so it uses only a new or empty local directory, or one holding
    nothing but an earlier demo's snapshots (its marker file says so)."""
    if "://" in dirpath and not dirpath.startswith("file://"):
        return f"--dirpath {dirpath}: the demo writes to a local directory"
    path = dirpath[len("file://") :] if dirpath.startswith("file://") else dirpath
    if not os.path.exists(path):
        return None
    if not os.path.isdir(path):
        return f"--dirpath {dirpath} is not a directory"
    names = set(os.listdir(path))
    if not names:
        return None
    if DEMO_MARKER not in names:
        return (
            f"--dirpath {dirpath} is not empty and was not written by the demo (it holds "
            f"{', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}); the demo deletes "
            "its earlier snapshots before each run, so give it a new or empty directory"
        )
    foreign = sorted(
        n for n in names
        if n not in (DEMO_MARKER, LOCK_FNAME) and SnapshotName.parse(n) is None and not is_staging_name(n)
    )
    if foreign:
        return (
            f"--dirpath {dirpath} holds files that are not the demo's snapshots ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}); give the demo a new or empty directory"
        )
    return None


def _clear(dirpath: str) -> None:
    """Make ``dirpath`` the demo's: remove an earlier demo's snapshots (only names this plugin
    writes; :func:`_refusal` has checked there is nothing else) and write the demo's marker."""
    path = dirpath[len("file://") :] if dirpath.startswith("file://") else dirpath
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(path):
        if SnapshotName.parse(name) is not None or is_staging_name(name):
            target = os.path.join(path, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
    with open(os.path.join(path, DEMO_MARKER), "w") as f:
        f.write("snapshots written by tnt-snapshot-demo; the demo deletes them at its next run\n")


def _print_report(report: dict[str, Any]) -> None:
    print(f"framework: {report['framework']}   dirpath: {report['dirpath']}")
    print(f"first run: {report.get('interrupted', 'not interrupted')} after {report['first_run_s']:.2f}s")
    print("snapshots committed before the crash:")
    print("  snapshot                     stall (ms)   durable (ms)")
    for rec in report["saved"]:
        name = rec.path.rstrip("/").rsplit("/", 1)[-1]
        print(f"  {name:<28} {rec.stall_s * 1e3:>10.2f}   {rec.durable_s * 1e3:>12.2f}")
    print(
        f"restored epoch {report['restored_epoch']}, step {report['restored_step']} "
        f"in {report['restore_s'] * 1e3:.1f} ms into a fresh model"
    )
    print(
        f"resumed run: {len(report['saved_after_resume'])} more snapshots, reached step "
        f"{report['final_step']} in {report['resumed_run_s']:.2f}s"
    )
    verdict = "yes" if report["bitwise_identical"] else "NO"
    print(f"final weights bitwise equal to an uninterrupted run: {verdict}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    available = adapters()
    parser = argparse.ArgumentParser(prog="tnt-snapshot-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=sorted(available), default="torchtnt")
    parser.add_argument("--dirpath", default=DEFAULT_DIRPATH, help=f"default: {DEFAULT_DIRPATH}")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps-per-epoch", type=int, default=12)
    parser.add_argument(
        "--interrupt-at", type=int, default=None, help="global step to crash at (default: mid-run)"
    )
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.steps_per_epoch < 2:
        parser.error("--epochs must be >= 1 and --steps-per-epoch >= 2")
    total = args.epochs * args.steps_per_epoch
    interrupt_at = args.interrupt_at if args.interrupt_at is not None else total // 2 + 1
    if not 0 < interrupt_at < total:
        parser.error(f"--interrupt-at must be between 1 and {total - 1}")

    refusal = _refusal(args.dirpath)
    if refusal is not None:
        parser.error(refusal)
    _clear(args.dirpath)
    demo = available[args.framework].load_demo()
    report = demo(
        args.dirpath,
        epochs=args.epochs,
        steps_per_epoch=args.steps_per_epoch,
        interrupt_at=interrupt_at,
    )
    _print_report(report)
    _print_listing(args.dirpath)
    return 0 if report["bitwise_identical"] else 1


def _print_listing(dirpath: str) -> None:
    """What ``tnt-snapshot ls`` says of the demo's directory."""
    print(f"\n$ tnt-snapshot ls {dirpath}", flush=True)
    from tnt_snapshot_plugin.cli import (
        main as cli_main,  # without the cli extra: one line saying how to install it
    )

    cli_main(["ls", dirpath])


if __name__ == "__main__":
    sys.exit(main())
