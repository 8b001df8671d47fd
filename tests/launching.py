"""Start the processes of a multi-process test and collect what each rank recorded.

Every rank is a new Python process (``command(rank)``), writing its output to a log and its
record (tests/gloo_worker.py) to ``record(rank)``. One deadline covers the whole group: a group
that hangs is killed and the test fails with every rank's output, so a deadlock never hangs CI;
a rank that failed leaves its peers a short grace period to record their side, then they are
stopped instead of waiting out their collective timeouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

#: One launch's limit (the groups take 5-20 s here; the workers' collective timeouts are 60-120 s).
DEADLINE_S = 180
FAILURE_GRACE_S = 10


def run_ranks(
    command: Callable[[int], list[str]],
    world: int,
    logs: Callable[[int], Path],
    record: Callable[[int], Path],
    label: str,
) -> list[dict[str, Any]]:
    """Run ``python *command(rank)`` for every rank at once; every rank's record (each one
    ``ok``), or a test failure naming ``label`` with every rank's output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    files = [open(logs(rank), "w+") for rank in range(world)]
    procs = [
        subprocess.Popen([sys.executable, *command(rank)], stdout=files[rank], stderr=subprocess.STDOUT, env=env)
        for rank in range(world)
    ]
    hung = False
    deadline = time.monotonic() + DEADLINE_S
    first_failure: Optional[float] = None
    try:
        while any(proc.poll() is None for proc in procs):
            now = time.monotonic()
            if first_failure is None and any(proc.poll() not in (None, 0) for proc in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now > first_failure + FAILURE_GRACE_S):
                hung = now > deadline
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    output = []
    for rank, file in enumerate(files):
        file.seek(0)
        output.append(f"--- {label} rank {rank} (exit {procs[rank].returncode}) ---\n{file.read()[-4000:]}")
        file.close()
    if hung:
        pytest.fail(f"{label} hung past {DEADLINE_S}s; killed\n" + "\n".join(output))
    records = []
    for rank in range(world):
        path = record(rank)
        if not path.exists():
            pytest.fail(f"{label}: rank {rank} wrote no record (hung or crashed)\n" + "\n".join(output))
        records.append(json.loads(path.read_text()))
    for got in records:  # the rank that failed first explains why its peers were stopped
        assert got["ok"], f"{label}: rank {got['rank']} failed:\n{got.get('traceback')}\n" + "\n".join(output)
    return records


def run_phase(worker: Path, phase: str, world: int, out: Path) -> list[dict[str, Any]]:
    """:func:`run_ranks` of a worker run as ``worker PHASE RANK WORLD RENDEZVOUS OUTDIR`` that
    writes its record to ``OUTDIR/PHASE_rank{RANK}.json`` (tests/fsdp_worker.py, by_rank_worker.py)."""
    return run_ranks(
        lambda rank: [str(worker), phase, str(rank), str(world), str(out / f"rendezvous_{phase}"), str(out)],
        world,
        lambda rank: out / f"{phase}{rank}.log",
        lambda rank: out / f"{phase}_rank{rank}.json",
        phase,
    )


def run_scenario(worker: Path, scenario: str, world: int, out: Path) -> list[dict[str, Any]]:
    """:func:`run_ranks` of a worker run as ``worker SCENARIO RANK WORLD RENDEZVOUS OUTDIR`` that
    writes its record to ``OUTDIR/rank{RANK}.json`` (tests/dist_worker.py, failure_kinds_worker.py)."""
    return run_ranks(
        lambda rank: [str(worker), scenario, str(rank), str(world), str(out / "rendezvous"), str(out)],
        world,
        lambda rank: out / f"rank{rank}.log",
        lambda rank: out / f"rank{rank}.json",
        f"scenario {scenario!r}",
    )
