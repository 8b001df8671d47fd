"""Crash points: the writer killed at each storage operation of a save, its commit and its
retention, on local disk, on S3 (moto's server) and through fsspec (s3fs on moto's server).

The scenario (tests/crash_point_worker.py, a fork server that imports torch and torchtnt once):
dirpath holds ``epoch_0_step_1``; a run restores it and trains step 2 with a saver keeping the
last snapshot, so it takes the dirpath, writes ``epoch_0_step_2``, commits it, deletes
``epoch_0_step_1`` and lets the dirpath go. First that run is traced: every operation on the
storage, in order (on local disk the system calls that change files; on S3 every HTTP request;
through fsspec every call on the filesystem object). Then, for each crash point, the same run
on a fresh copy of the dirpath kills itself (SIGKILL) right before that operation, or halfway
through a write on local disk. A fresh process then

* finds only complete snapshots that verify, among them the previous one if the kill came before
  the commit (the rename of the staging directory on disk, ``.snapshot_metadata`` written on an
  object store), the new one if after;
* restores exactly that snapshot, bitwise (model, optimizer, LR scheduler, progress, loader,
  RNGs), without a warning, except after a kill between the index and the metadata on an object
  store: restore then warns once that the new snapshot holds the index but no metadata;
* trains one more step as the next run: it commits, leaves nothing else in dirpath (the killed
  run's leftovers, the fsspec store's write probe included, and the older snapshot are gone), and
  restores bitwise.

Which crash points run: by default a sample, the first operation and the first change of each
kind to each kind of file (payload files are one kind; the index, the metadata, the writer
marker, the lock or lease, each directory are kinds of their own, and each change to them
counts); a kill before a read leaves what a kill before the next change leaves. With
``TNT_CRASH_POINTS=all`` in the environment, every operation, reads included, and on local disk
the middle of every write too. The tests are the same ones either way, named ``...[local-sample]``
or ``...[local-all]``; nothing is skipped. Each prints how many operations it found and how many
points it ran (``pytest -s``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
from moto_s3 import DEAD_ENDPOINT, as_s3fs, create_bucket, moto_options, s3_client

WORKER = Path(__file__).parent / "crash_point_worker.py"

_SELECTION = os.environ.get("TNT_CRASH_POINTS", "") or "sample"
if _SELECTION not in ("sample", "all"):
    raise ValueError(f"TNT_CRASH_POINTS must be 'all' or 'sample' (or unset), got {_SELECTION!r}")

S3_BUCKET, FSSPEC_BUCKET = "crash-points", "crash-points-fsspec"
PREVIOUS, NEW = "epoch_0_step_1", "epoch_0_step_2"
#: The most one run of the worker may take (a point is three runs); the server kills it then.
RUN_TIMEOUT_S = 120

#: Per backend, the operation that commits the new snapshot, the first one of the retention
#: deleting the previous one, and the last one of the run (the dirpath let go).
COMMIT = {
    "local": ("rename", f".tnt_staging.{NEW}.<token> -> {NEW}"),
    "s3": ("PUT", f"{NEW}/.snapshot_metadata"),
    "fsspec": ("pipe_file", f"{NEW}/.snapshot_metadata"),
}
RETENTION = {
    "local": ("rename", f"{PREVIOUS} -> .tnt_staging.{PREVIOUS}.del<id>/{PREVIOUS}"),
    "s3": ("DELETE", f"{PREVIOUS}/.snapshot_metadata"),
    "fsspec": ("rm_file", f"{PREVIOUS}/.snapshot_metadata"),
}
RELEASE = {
    "local": ("unlink", ".tnt_snapshot.lock"),
    "s3": ("DELETE", ".tnt_snapshot.lease.json"),
    "fsspec": ("rm_file", ".tnt_snapshot.lease.json"),
}
#: On an object store, the index written just before the metadata: a kill between the two leaves
#: the new snapshot's name holding the index and no metadata, which restore skips with a warning
#: that says so (restoring/latest.py: such a directory may also be damage).
INDEX_WRITTEN = {
    "s3": ("PUT", f"{NEW}/.tnt_snapshot_index.json"),
    "fsspec": ("pipe_file", f"{NEW}/.tnt_snapshot_index.json"),
}
INTERRUPTED_COMMIT = (
    rf"InterruptedCommitWarning: snapshot \S+/{NEW} is an interrupted commit \(the writer is gone: "
    r".*nothing committed is lost"
)
#: The fsspec store's write probe (stores/fsspec.py check_writable: written, then removed, when the
#: saver is made): a kill between the two leaves it in dirpath until the next saver's check, which
#: removes it once the process that wrote it is gone.
FSSPEC_PROBE = (("pipe_file", ".tnt_write_probe.<token>"), ("rm_file", ".tnt_write_probe.<token>"))
#: Operations that only read (S3 requests, fsspec calls); every other one may change what is stored.
READS = frozenset({
    "GET", "HEAD", "LIST",
    "ls", "info", "cat_file", "cat", "find", "exists", "isfile", "isdir", "glob", "du", "size", "walk",
})
#: Files that are each a kind of their own (not payload) in the sample.
OWN_KIND = frozenset({
    ".tnt_writer.json", ".tnt_snapshot_index.json", ".snapshot_metadata", ".tnt_snapshot.lock",
    ".tnt_snapshot.lease.json",
})


class Worker:
    """tests/crash_point_worker.py, and one reply per request."""

    def __init__(self, tmp: Path) -> None:
        self._stderr_path = tmp / "crash_point_worker.stderr"
        self._stderr = open(self._stderr_path, "wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(
            AWS_ENDPOINT_URL=DEAD_ENDPOINT, AWS_ENDPOINT_URL_S3=DEAD_ENDPOINT, AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true", OMP_NUM_THREADS="1",
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._stderr, env=env, cwd=tmp,
        )
        self._lines: queue.Queue[Optional[bytes]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._next(timeout=240)  # {"ready": true}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no reply from the worker in {timeout}s\n{self.stderr()}") from None
        if line is None:
            raise AssertionError(f"the worker exited\n{self.stderr()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, op: str, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"op": op, "timeout_s": RUN_TIMEOUT_S, **request}) + "\n").encode())
        self.proc.stdin.flush()
        return self._next(timeout=RUN_TIMEOUT_S + 60)

    def result(self, op: str, **request: Any) -> dict[str, Any]:
        """The result of a run that must end normally."""
        reply = self.run(op, **request)
        if reply["exit_code"] != 0 or reply["result"] is None:
            raise AssertionError(f"the {op} run failed ({reply['signal']=}, {reply['exit_code']=}):\n"
                                 f"{reply['error']}\n{self.stderr()}")
        return reply["result"]  # type: ignore[no-any-return]

    def stderr(self) -> str:
        self._stderr.flush()
        return "the worker's stderr (tail):\n" + self._stderr_path.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout, self._stderr):
            if stream is not None:
                stream.close()


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("crash_point_worker"))
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def reference(worker) -> dict[str, dict[str, Any]]:
    """The fingerprint after each of steps 1-3 of an uninterrupted run without a saver."""
    steps = worker.result("reference")["steps"]
    assert sorted(steps) == ["1", "2", "3"]
    return steps  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def moto_buckets(moto_endpoint):
    """The module's moto server, holding the buckets of the S3 and fsspec backends."""
    for bucket in (S3_BUCKET, FSSPEC_BUCKET):
        create_bucket(moto_options(moto_endpoint), bucket)
    return moto_endpoint


class Dirpaths:
    """Dirpaths of one backend (and their storage_options): each crash point's run gets a fresh
    copy of the template, the dirpath the set-up run wrote ``epoch_0_step_1`` to."""

    def __init__(self, backend: str, tmp_path: Path, endpoint: Optional[str]) -> None:
        self.backend, self._tmp, self._count = backend, Path(os.path.realpath(tmp_path)), 0
        self.options: Optional[dict[str, Any]] = None
        self._client: Any = None
        self.template = ""
        if endpoint is not None:
            self.options = moto_options(endpoint) if backend == "s3" else as_s3fs(moto_options(endpoint))
            self._client = s3_client(moto_options(endpoint))

    def new(self) -> str:
        self._count += 1
        run = f"run-{self._count}-{uuid.uuid4().hex[:8]}"
        if self.backend == "s3":
            return f"s3://{S3_BUCKET}/{run}"
        if self.backend == "fsspec":
            return f"s3a://{FSSPEC_BUCKET}/{run}"
        return str(self._tmp / run)

    def copy(self) -> str:
        """A new dirpath holding what the template holds, byte for byte."""
        dirpath = self.new()
        if self._client is None:
            shutil.copytree(self.template, dirpath, symlinks=True)
            return dirpath
        bucket, _, source = self.template.split("://", 1)[1].partition("/")
        target = dirpath.split("://", 1)[1].partition("/")[2]
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=source + "/")
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        assert keys, f"the template {self.template} is empty"
        for key in keys:
            self._client.copy_object(
                Bucket=bucket, Key=target + key[len(source):], CopySource={"Bucket": bucket, "Key": key}
            )
        return dirpath


@dataclass(frozen=True)
class Point:
    """Where a run is killed: right before (or, ``mid``, halfway through) the ``n``-th operation
    ``kind`` on ``target``, at ``index`` in the trace."""

    index: int
    kind: str
    target: str
    n: int
    mid: bool = False

    @property
    def key(self) -> list[Any]:
        return [self.kind, self.target, self.n]

    def __str__(self) -> str:
        return f"{'halfway through' if self.mid else 'before'} {self.kind} {self.target} #{self.n} (op {self.index})"


def crash_points(ops: list[list[Any]], backend: str) -> list[Point]:
    """Every operation of the trace; on local disk also the middle of every write."""
    points = []
    for index, (kind, target, n, nbytes) in enumerate(ops):
        points.append(Point(index, kind, target, n))
        if backend == "local" and kind == "write" and nbytes >= 2:
            points.append(Point(index, kind, target, n, mid=True))
    return points


def kind_of_file(target: str) -> str:
    """``target`` with the payload part of each path folded into ``<payload>``."""

    def fold(path: str) -> str:
        kept = []
        for part in path.split("/"):
            if part in OWN_KIND or part.startswith((".", "(", "epoch_")):
                kept.append(part)
            else:
                kept.append("<payload>")
                break
        return "/".join(kept)

    return " -> ".join(
        ", ".join(sorted({fold(p) for p in side.split(", ")})) for side in target.split(" -> ")
    )


def sample(points: list[Point]) -> list[Point]:
    """The first operation, and the first change of each kind to each kind of file (each change
    to a file or directory of a kind of its own: the index, the metadata, ...). A kill before a
    read leaves what a kill before the next change leaves: reads are in the full enumeration."""
    seen: set[tuple[Any, ...]] = set()
    chosen = points[:1]
    for point in points[1:]:
        if point.kind in READS:
            continue
        folded = kind_of_file(point.target)
        kind = (point.kind, folded, point.mid, point.n if folded == point.target else 0)
        if kind not in seen:
            seen.add(kind)
            chosen.append(point)
    return chosen


def expected_step(point: Point, commit: int) -> int:
    """Which snapshot a kill at ``point`` leaves as the latest: the new one (step 2) once the
    commit (at ``commit`` in the trace) has run, else the previous one."""
    return 2 if point.index > commit else 1


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def problems(
    report: dict[str, Any], step: int, reference: dict[str, dict[str, Any]], *,
    interrupted_commit: bool = False,
) -> list[str]:
    """What is wrong with a check run's report, the latest snapshot being expected at ``step``.

    ``interrupted_commit``: restore warns, exactly once, that the new snapshot holds the index
    but no metadata."""
    out = []
    expected, other = (PREVIOUS, NEW) if step == 1 else (NEW, PREVIOUS)
    complete = report["complete"]
    if expected not in complete or not set(complete) <= {PREVIOUS, NEW} or (step == 1 and NEW in complete):
        out.append(f"complete snapshots {complete}, expected {expected} (and perhaps {other}, if older)")
    if report["damaged"]:
        out.append(f"damaged complete snapshots: {report['damaged']}")
    if not report["restored"]:
        out.append("restore_from_latest found nothing to restore")
    elif report["fingerprint"] != reference[str(step)]:
        out.append(
            f"restored step {report['fingerprint']['step']}, not exactly step {step}: "
            f"{differing(report['fingerprint'], reference[str(step)])} differ"
        )
    warned = report["restore_warnings"]
    if interrupted_commit:
        if len(warned) != 1 or not re.match(INTERRUPTED_COMMIT, warned[0]):
            out.append(f"restore did not warn once that {NEW}'s commit was interrupted: {warned}")
    elif warned:
        out.append(f"restore warned: {warned}")
    following = str(step + 1)
    if report["next_steps"].get(following) != reference[following]:
        out.append(f"the next run's step {following} is not the uninterrupted run's: {report['next_steps']}")
    if report["next_warnings"]:
        out.append(f"the next run warned: {report['next_warnings']}")
    if report["after_next"] != [f"epoch_0_step_{following}"]:
        out.append(f"after the next run dirpath holds {report['after_next']}, expected only epoch_0_step_{following}")
    if not report["next_restored"] or report["next_fingerprint"] != reference[following]:
        out.append(f"the next run's snapshot does not restore step {following} exactly")
    if report["next_restore_warnings"]:
        out.append(f"restoring the next run's snapshot warned: {report['next_restore_warnings']}")
    return out


def index_of(ops: list[list[Any]], op: tuple[str, str]) -> int:
    found = [i for i, (kind, target, _n, _b) in enumerate(ops) if (kind, target) == op]
    assert len(found) == 1, f"{op} is in the trace {len(found)} times, expected once:\n" + "\n".join(map(str, ops))
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("selection", [_SELECTION])
@pytest.mark.parametrize("backend", ["local", "s3", "fsspec"])
def test_a_kill_at_any_storage_operation_restores_the_previous_or_the_new_snapshot(
    backend, selection, worker, reference, tmp_path, request
):
    endpoint = request.getfixturevalue("moto_buckets") if backend != "local" else None
    dirpaths = Dirpaths(backend, tmp_path, endpoint)
    options = dirpaths.options

    dirpaths.template = dirpaths.new()
    steps = worker.result("setup", dirpath=dirpaths.template, options=options, backend=backend)["steps"]
    assert steps == {"1": reference["1"]}, "the set-up run is not the uninterrupted run"

    # The trace: the run uninterrupted, every operation in order, with commit and retention in it.
    dirpath = dirpaths.copy()
    traced = worker.result("save", dirpath=dirpath, options=options, backend=backend)
    assert traced["steps"] == {"2": reference["2"]}, "the traced run is not the uninterrupted run"
    ops = traced["ops"]
    commit = index_of(ops, COMMIT[backend])
    assert commit < index_of(ops, RETENTION[backend]), "retention ran before the commit"
    assert ops[-1][:2] == list(RELEASE[backend]), f"the run's last operation is {ops[-1]}"
    assert problems(worker.result("check", dirpath=dirpath, options=options, backend=backend), 2, reference) == []

    every = crash_points(ops, backend)
    points = every if selection == "all" else sample(every)
    if backend == "fsspec":  # a kill between the probe's write and its removal is always tried
        assert index_of(ops, FSSPEC_PROBE[1]) in [p.index for p in points]
    print(f"\n{backend}: {len(ops)} operations, {len(every)} crash points, {len(points)} run ({selection})")
    failures: list[str] = []
    outcomes = {1: 0, 2: 0}
    index_written = index_of(ops, INDEX_WRITTEN[backend]) if backend in INDEX_WRITTEN else commit
    for point in points:
        step = expected_step(point, commit)
        dirpath = dirpaths.copy()
        killed = worker.run("save", dirpath=dirpath, options=options, backend=backend,
                            kill={"key": point.key, "mid": point.mid})
        if killed["signal"] != signal.SIGKILL:
            failures.append(f"{point}: the run was not killed there ({killed['exit_code']=}): {killed['error']}")
            continue
        report = worker.result("check", dirpath=dirpath, options=options, backend=backend)
        wrong = problems(
            report, step, reference,
            interrupted_commit=index_written < point.index <= commit,
        )
        failures += [f"{point}: {why}" for why in wrong]
        outcomes[step] += not wrong
    print(f"{backend}: restored the previous snapshot after {outcomes[1]} kills, the new one after {outcomes[2]}")
    assert not failures, f"{len(failures)} wrong outcomes at {len(points)} crash points:\n" + "\n".join(failures)
    assert outcomes[1] and outcomes[2], outcomes  # kills before and after the commit both ran
