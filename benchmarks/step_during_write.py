#!/usr/bin/env python
"""Step time during a write: how much slower training steps run while a snapshot is being
written in the background, for each asynchronous checkpointer.

    python benchmarks/step_during_write.py                  # 64 MiB and 1 GiB, 1 and 2 gloo ranks
    python benchmarks/step_during_write.py --quick          # 64 MiB, 1 rank, 2 rounds
    python benchmarks/step_during_write.py --sizes 1GiB --ranks 2 --methods plugin DCP
    python benchmarks/step_during_write.py --out sdw.json --plot sdw.png

A real ``torchtnt.framework.train`` loop runs one of two steps: ``python-heavy`` (many small ops:
a stack of tiny layers, layer norm, linear, GELU, linear, residual, as a transformer layer
launches kernels, about 3,000 ops) or ``one-large-op`` (one 1024 x 1024 matrix product). Both take
about 20 ms on one core of the project's machine. The state the checkpointer saves is a module of
fp32 tensors of the given size; on 2 ranks each rank holds a state of that size of its own (as
sharded training does) and writes it.

Every ``K`` steps the method snapshots through its own cadence. ``K`` comes from a calibration run
of the method (the faster of its first two writes over the step time, divided by 0.75), so that one
write follows another closely and is usually done before the next is due (steps that a write slows
down make fewer of them fit in it, and the share of in-flight steps lower). Each step's body is timed, and
the method's own signal says, right before and right after it, whether a write is in flight:

* tnt_snapshot_plugin: ``snapshotter.jobs.pending`` is a job whose write is not done;
* torch.distributed.checkpoint ``async_save`` (thread and ``AsyncCheckpointerType.PROCESS``, from
  a torchtnt callback that waits for the previous save before the next): its future not done;
* torchtnt's ``TorchSnapshotSaver`` and ``DistributedCheckpointSaver`` (async): their pending
  snapshot (``_prev_snapshot``) not done;
* Lightning's ``AsyncCheckpointIO`` (over ``TorchCheckpointIO``, given the checkpoint dict that
  ``Trainer.save_checkpoint`` hands it): the future of its executor's last submitted save not done.

A step with a write in flight at both ends is "in flight"; with none at either end, "quiet"; the
others (the write ended during the step) are counted apart and left out of the ratios, unless no
step was in flight at both ends (every write of the method ended within a step): then they stand
for the in-flight steps, and the figures say so ("partly in flight"). The figures:
the median and p95 of in-flight steps divided by those of quiet steps. The first two steps of each
run warm up and are left out. A write's end is each method's own: the plugin and DCP fsync their
files; torchtnt's TorchSnapshotSaver and Lightning do not.

Each method runs in a fresh subprocess (one per rank), in interleaved rounds: every method once per
round and step kind, the order rotated each round. The plugin runs twice: with its thread writer
(``Knobs(writer="thread")``) and with its process writer (``Knobs(writer="process")``: a writer
process per rank, started at train start, reading the staged copies from shared memory).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any, Callable, Optional

MiB = 1024 * 1024
GiB = 1024 * MiB

#: the share of steps a write is meant to be in flight for (``K`` = write time / step time / this)
IN_FLIGHT_SHARE = 0.75
#: steps at the start of every run left out (first touches, lazy initialisation)
WARMUP_STEPS = 2

PLUGIN = "tnt_snapshot_plugin (thread writer)"
PLUGIN_PROCESS = "tnt_snapshot_plugin (process writer)"
DCP_THREAD = "torch.distributed.checkpoint async_save (thread)"
DCP_PROCESS = "torch.distributed.checkpoint async_save (PROCESS)"
TNT_SNAPSHOT = "torchtnt TorchSnapshotSaver async"
TNT_DCP = "torchtnt DistributedCheckpointSaver async"
LIGHTNING = "Lightning AsyncCheckpointIO"

#: every row, in the order of the tables; False: the row's checkpointer is not built
METHODS: dict[str, bool] = {
    PLUGIN: True,
    PLUGIN_PROCESS: True,
    DCP_THREAD: True,
    DCP_PROCESS: True,
    TNT_SNAPSHOT: True,
    TNT_DCP: True,
    LIGHTNING: True,
}
PEERS = {DCP_THREAD, DCP_PROCESS, TNT_SNAPSHOT, TNT_DCP, LIGHTNING}

KINDS = ("python-heavy", "one-large-op")


@dataclass(frozen=True)
class Work:
    """How much a step does: ``layers`` tiny layers of 6 ops (python-heavy); an ``n`` x ``n``
    matrix product (one-large-op)."""

    layers: int
    n: int


#: about 20 ms a step on one core of the project's machine; smoke: under 1 ms
WORK = {"full": Work(layers=500, n=1024), "smoke": Work(layers=20, n=320)}


@dataclass(frozen=True)
class Config:
    """A state of ``count`` fp32 tensors of ``shape`` on each of ``ranks`` ranks."""

    label: str
    count: int
    shape: tuple[int, int]
    ranks: int

    @property
    def nbytes(self) -> int:
        return 4 * self.shape[0] * self.shape[1] * self.count


SIZES = {
    "64MiB": ("64 MiB (16 x 4 MiB)", 16, (1024, 1024)),
    "1GiB": ("1 GiB (64 x 16 MiB)", 64, (2048, 2048)),
    "8MiB": ("8 MiB (8 x 1 MiB)", 8, (512, 512)),
}


@dataclass(frozen=True)
class Effort:
    """Which states and rank counts, rounds per method and step kind, snapshots per run (more
    where K is small, so that a run has at least ``min_steps`` steps), and the step's work."""

    sizes: tuple[str, ...]
    ranks: tuple[int, ...]
    rounds: int
    snapshots: int
    work: str
    min_steps: int = 60


EFFORT = {
    "full": Effort(("64MiB", "1GiB"), (1, 2), rounds=2, snapshots=2, work="full"),
    "quick": Effort(("64MiB",), (1,), rounds=2, snapshots=3, work="full"),
    "smoke": Effort(("8MiB",), (1,), rounds=1, snapshots=2, work="smoke", min_steps=20),
}


def configs(sizes: tuple[str, ...], ranks: tuple[int, ...]) -> list[Config]:
    out = []
    for size in sizes:
        label, count, shape = SIZES[size]
        for n in ranks:
            out.append(Config(f"{label}, {n} rank{'s' if n > 1 else ''}", count, shape, n))
    return out


# ================================================================================================
# one rank of one run (in a fresh subprocess)


def _state(config: dict[str, Any], rank: int) -> Any:
    """The saved state: a module whose parameters are this rank's own (keys carry the rank)."""
    import torch

    inner = torch.nn.Module()
    for i in range(config["count"]):
        t = torch.empty(config["shape"]).fill_(float(rank * 1000 + i))
        inner.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    model = torch.nn.Module()
    model.add_module(f"rank{rank}", inner)
    return model


def _step(kind: str, work: Work) -> Callable[[], None]:
    """The body of one training step of ``kind``."""
    import torch

    F = torch.nn.functional
    gen = torch.Generator().manual_seed(0)
    if kind == "python-heavy":
        weights = [torch.randn(64, 64, generator=gen) * 0.1 for _ in range(48)]
        x0 = torch.randn(8, 64, generator=gen)

        def python_heavy() -> None:
            with torch.no_grad():
                x = x0
                for i in range(work.layers):
                    h = F.layer_norm(x, (64,))
                    h = F.linear(h, weights[(2 * i) % 48])
                    h = F.gelu(h)
                    h = F.linear(h, weights[(2 * i + 1) % 48])
                    x = x + h
                    x = x * 0.5

        return python_heavy
    a = torch.randn(work.n, work.n, generator=gen)
    b = torch.randn(work.n, work.n, generator=gen)
    c = torch.empty(work.n, work.n)

    def one_large_op() -> None:
        torch.mm(a, b, out=c)

    return one_large_op


class _Signal:
    """A method's own word on its write: ``handle()`` the write in hand (None: none yet),
    ``done(handle)`` whether that write is over."""

    def __init__(self, handle: Callable[[], Any], done: Callable[[Any], bool]) -> None:
        self.handle = handle
        self.done = done

    def in_flight(self) -> Optional[Any]:
        h = self.handle()
        return h if h is not None and not self.done(h) else None


def _method(name: str, root: str, every: int, rank: int) -> tuple[list[Any], _Signal]:
    """(torchtnt callbacks, signal) of method ``name`` snapshotting every ``every`` steps to ``root``."""
    from torchtnt.framework.callback import Callback

    if name in (PLUGIN, PLUGIN_PROCESS):
        from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
        from tnt_snapshot_plugin.config import Knobs

        saver = TorchSnapshotSaver(
            root, save_every_n_train_steps=every, keep_last_n_snapshots=1, save_on_train_end=False,
            knob_options=Knobs(writer="process" if name == PLUGIN_PROCESS else "thread"),
        )
        jobs = saver.snapshotter.jobs
        return [saver], _Signal(lambda: jobs.pending, lambda job: job.done)
    if name == TNT_SNAPSHOT:
        from torchtnt.framework.callbacks import TorchSnapshotSaver as TntSaver

        tnt = TntSaver(root, save_every_n_train_steps=every, keep_last_n_checkpoints=1, async_checkpoint=True)
        return [tnt], _Signal(lambda: tnt._prev_snapshot, lambda p: p.done())
    if name == TNT_DCP:
        from torchtnt.framework.callbacks import DistributedCheckpointSaver

        dcp_saver = DistributedCheckpointSaver(
            root, save_every_n_train_steps=every, keep_last_n_checkpoints=1, async_checkpoint=True
        )
        return [dcp_saver], _Signal(lambda: dcp_saver._prev_snapshot, lambda f: f.done())
    if name in (DCP_THREAD, DCP_PROCESS):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if name == DCP_PROCESS else AsyncCheckpointerType.THREAD

        class DCPAsyncSave(Callback):
            """``dcp.async_save`` of the unit's model every ``every`` steps, as DCP's docs show:
            the previous save waited for before the next; rank 0 deletes the one before."""

            def __init__(self) -> None:
                self.future: Any = None
                self.paths: list[str] = []

            def on_train_step_end(self, state: Any, unit: Any) -> None:
                step = unit.train_progress.num_steps_completed
                if step % every:
                    return
                if self.future is not None:
                    self.future.result()
                    while rank == 0 and len(self.paths) > 1:
                        shutil.rmtree(self.paths.pop(0), ignore_errors=True)
                path = os.path.join(root, f"step_{step}")
                self.paths.append(path)
                self.future = dcp.async_save(
                    {"model": unit.model.state_dict()}, checkpoint_id=path, async_checkpointer_type=kind
                )

            def on_train_end(self, state: Any, unit: Any) -> None:
                if self.future is not None:
                    self.future.result()

        cb = DCPAsyncSave()
        return [cb], _Signal(lambda: cb.future, lambda f: f.done())
    if name == LIGHTNING:
        from concurrent.futures import Future, ThreadPoolExecutor

        from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
        from pytorch_lightning.plugins.io import AsyncCheckpointIO

        class Recording(ThreadPoolExecutor):
            """AsyncCheckpointIO's executor, keeping the future of the last save submitted."""

            last: Optional[Future] = None

            def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
                self.last = super().submit(fn, *args, **kwargs)
                return self.last

        aio = AsyncCheckpointIO(TorchCheckpointIO())
        executor = Recording(max_workers=1)
        aio._executor = executor  # what _ensure_setup() would make, with its futures kept

        class LightningAsync(Callback):
            """What ModelCheckpoint does through ``Trainer.save_checkpoint``: hand the
            checkpoint dict to the strategy's CheckpointIO, here AsyncCheckpointIO; each rank
            writes its own file; written files but the newest are deleted once written."""

            def __init__(self) -> None:
                self.written: list[tuple[Future, str]] = []

            def on_train_step_end(self, state: Any, unit: Any) -> None:
                step = unit.train_progress.num_steps_completed
                if step % every:
                    return
                path = os.path.join(root, f"step_{step}_rank{rank}.ckpt")
                checkpoint = {"epoch": 0, "global_step": step, "state_dict": unit.model.state_dict()}
                aio.save_checkpoint(checkpoint, path)
                assert executor.last is not None
                self.written.append((executor.last, path))
                while len(self.written) > 1 and self.written[0][0].done():
                    os.remove(self.written.pop(0)[1])

            def on_train_end(self, state: Any, unit: Any) -> None:
                aio.teardown()

        return [LightningAsync()], _Signal(lambda: executor.last, lambda f: f.done())
    raise SystemExit(f"unknown method {name!r}")


def _unit(model: Any, body: Callable[[], None], probe: Callable[[], Optional[Any]]) -> Any:
    from torchtnt.framework.unit import TrainUnit

    class TimedUnit(TrainUnit[Any]):
        """Times each step's body; asks the method, right before and right after it, which
        write (if any) is in flight."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.steps: list[tuple[float, bool, bool]] = []  # (seconds, in flight before, after)
            #: each write seen in flight: [its handle, first and last perf_counter seen in flight]
            self.writes: list[list[Any]] = []

        def _look(self) -> bool:
            h = probe()
            if h is None:
                return False
            now = time.perf_counter()
            if self.writes and self.writes[-1][0] is h:
                self.writes[-1][2] = now
            else:
                self.writes.append([h, now, now])
            return True

        def train_step(self, state: Any, data: Any) -> None:
            before = self._look()
            t = time.perf_counter()
            body()
            elapsed = time.perf_counter() - t
            self.steps.append((elapsed, before, self._look()))

    return TimedUnit()


def _watch(signal: _Signal, stop: threading.Event, durations: list[float]) -> None:
    """Calibration only: each write's duration, from the signal polled every 2 ms, from the moment
    its handle appears until it is done (a write queued behind another counts its wait)."""
    seen: list[list[Any]] = []  # [handle, first seen, done at (0.0: not yet)]

    def look() -> None:
        h = signal.handle()
        now = time.perf_counter()
        if h is not None and not any(h is w[0] for w in seen):
            seen.append([h, now, 0.0])
        for w in seen:
            if not w[2] and signal.done(w[0]):
                w[2] = now

    while not stop.wait(0.002):
        look()
    look()
    durations.extend(done - first for _, first, done in seen if done)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of one run: ``spec`` says the method, the step kind, the state, ``every`` (K)
    and the number of steps; ``calibrate`` instead measures the step times and the writes."""
    import logging
    import warnings

    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist
    from torchtnt.framework.train import train

    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world_size"]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank, world_size=world
    )
    work = Work(**spec["work"])
    model = _state(spec["config"], rank)
    out: dict[str, Any] = {"rank": rank}
    if spec["calibrate"]:
        step_s = {}
        for kind in KINDS:
            body = _step(kind, work)
            body()
            times = []
            for _ in range(9):
                t = time.perf_counter()
                body()
                times.append(time.perf_counter() - t)
            step_s[kind] = statistics.median(times)
        out["step_s"] = step_s
    body = _step(spec["kind"], work)
    callbacks, signal = _method(spec["method"], spec["root"], spec["every"], rank)
    unit = _unit(model, body, signal.in_flight)
    durations: list[float] = []
    stop = threading.Event()
    watcher = None
    if spec["calibrate"]:
        watcher = threading.Thread(target=_watch, args=(signal, stop, durations), daemon=True)
        watcher.start()
    started = time.perf_counter()
    try:
        train(unit, range(spec["steps"]), max_epochs=1, callbacks=callbacks)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
    out["wall_s"] = time.perf_counter() - started
    out["steps"] = unit.steps
    out["writes_seen_s"] = [last - first for _, first, last in unit.writes]
    out["write_s"] = durations
    dist.barrier()
    if spec["method"] == DCP_PROCESS:  # stop DCP's checkpoint process before the group goes
        from torch.distributed.checkpoint import _async_process_executor as process_executor

        process_executor._CHECKPOINT_PROCESS = None
    dist.destroy_process_group()
    return out


# ================================================================================================
# the runs (parent process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(spec: dict[str, Any], ranks: int, workdir: str, timeout_s: float) -> list[dict[str, Any]]:
    """One run of ``spec`` on ``ranks`` fresh processes; every rank's result. A rank that fails
    ends the others (a rank left alone would wait in a collective)."""
    root = tempfile.mkdtemp(prefix="sdw_", dir=workdir)
    spec = {**spec, "root": root, "port": _free_port(), "world_size": ranks}
    outs = [os.path.join(root, f"rank{r}.json") for r in range(ranks)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"])}
    procs = []
    logs = []
    try:
        for r in range(ranks):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", json.dumps({**spec, "rank": r}), outs[r]],
                stdout=log, stderr=subprocess.STDOUT, text=True,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks)},
            ))
        deadline = time.monotonic() + timeout_s
        failed_at: Optional[float] = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > 20):
                break
            time.sleep(0.05)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if any(p.returncode != 0 for p in procs):
            tails = []
            for r, log in enumerate(logs):
                log.seek(0)
                tails.append(f"rank {r} (exit {procs[r].returncode}): " + log.read()[-1500:])
            raise RuntimeError("\n".join(tails))
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results
    finally:
        for log in logs:
            log.close()
        shutil.rmtree(root, ignore_errors=True)


def _p95(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def summarize(samples: list[tuple[float, bool, bool]], writes: list[float], every: list[int]) -> dict[str, Any]:
    """The figures of one method and step kind from its steps (every run and rank pooled).

    ``basis``: "in flight" (steps with a write in flight at both ends), or "partly in flight"
    where no step had one at both ends (every write ended within a step): the steps during which
    a write ended then stand for the in-flight ones."""
    quiet = [s for s, before, after in samples if not before and not after]
    flight = [s for s, before, after in samples if before and after]
    partly = [s for s, before, after in samples if before != after]
    out: dict[str, Any] = {
        "quiet_steps": len(quiet),
        "in_flight_steps": len(flight),
        "partial_steps": len(partly),
        "writes": len(writes),
        "write_s": statistics.median(writes) if writes else None,
        "every": every,
    }
    compared, out["basis"] = (flight, "in flight") if flight else (partly, "partly in flight")
    if quiet and compared:
        out.update(
            quiet_median_s=statistics.median(quiet),
            quiet_p95_s=_p95(quiet),
            in_flight_median_s=statistics.median(compared),
            in_flight_p95_s=_p95(compared),
        )
        out["median_ratio"] = out["in_flight_median_s"] / out["quiet_median_s"]
        out["p95_ratio"] = out["in_flight_p95_s"] / out["quiet_p95_s"]
    else:
        out["error"] = f"no {'quiet' if not quiet else 'in-flight'} steps to compare"
    return out


def step_during_write(
    effort: Effort, methods: Optional[list[str]] = None, kinds: tuple[str, ...] = KINDS,
    workdir: Optional[str] = None, log: Any = sys.stderr, timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Every method (``methods``: names containing one of these; default all) on every state
    and rank count of ``effort``; the JSON-ready results (see the module doc)."""
    names = [n for n in METHODS if not methods or any(m.lower() in n.lower() for m in methods)]
    if not names:
        raise SystemExit(f"no method matches {methods}; methods: {list(METHODS)}")
    built = [n for n in names if METHODS[n]]
    work = WORK[effort.work]
    scratch = tempfile.mkdtemp(prefix="tnt_bench_sdw_", dir=workdir)
    results: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": metadata.version("torch"),
            "platform": platform.platform(), "load_average_at_start": os.getloadavg(),
        },
        "rounds": effort.rounds, "snapshots_per_run": effort.snapshots, "min_steps": effort.min_steps,
        "warmup_steps": WARMUP_STEPS,
        "in_flight_share": IN_FLIGHT_SHARE, "work": asdict(work), "kinds": list(kinds), "configs": [],
    }
    try:
        for config in configs(effort.sizes, effort.ranks):
            print(f"## step time during a write: {config.label}", file=log, flush=True)
            base = {"config": {"count": config.count, "shape": list(config.shape)}, "work": asdict(work)}
            rows: dict[str, dict[str, Any]] = {
                n: {"name": n, "peer": n in PEERS, "built": METHODS[n]} for n in names
            }
            for name in names:
                if not METHODS[name]:
                    rows[name]["note"] = "not built"
            # calibration: two writes of each method with the python-heavy step; both steps' times
            calibration: dict[str, dict[str, Any]] = {}
            for name in built:
                t = time.perf_counter()
                try:
                    ranks_out = _run({**base, "method": name, "kind": KINDS[0], "every": 3, "steps": 6,
                                      "calibrate": True}, config.ranks, scratch, timeout_s)
                except Exception as exc:
                    rows[name]["error"] = f"calibration: {type(exc).__name__}: {exc}"
                    print(f"  {name}: calibration FAILED {rows[name]['error'][:2000]}", file=log, flush=True)
                    continue
                # the faster of the two writes on each rank (the first pays first touches, DCP's
                # process start; the second may wait behind the first), the slowest rank's
                writes = [r["write_s"] for r in ranks_out]
                write_s = max(min(w) for w in writes) if all(writes) else None
                step_s = {k: max(r["step_s"][k] for r in ranks_out) for k in KINDS}
                if write_s is None:
                    rows[name]["error"] = "calibration: no write was seen"
                    continue
                calibration[name] = {"write_s": write_s, "step_s": step_s, "writes_s": writes}
                rows[name]["calibration"] = calibration[name]
                print(f"  {name}: calibration: write {write_s * 1000:.0f} ms, steps "
                      + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in step_s.items())
                      + f" ({time.perf_counter() - t:.0f}s)", file=log, flush=True)
            runnable = [n for n in built if n in calibration]
            pooled: dict[tuple[str, str], dict[str, list[Any]]] = {
                (n, k): {"steps": [], "writes": [], "every": [], "wall_s": []} for n in runnable for k in kinds
            }
            for rnd in range(effort.rounds):
                for kind in kinds:
                    order = runnable[rnd % max(1, len(runnable)):] + runnable[: rnd % max(1, len(runnable))]
                    for name in order:
                        cal = calibration[name]
                        every = max(2, math.ceil(cal["write_s"] / cal["step_s"][kind] / IN_FLIGHT_SHARE))
                        # snapshots at K, 2K, ...; K - 1 steps after the last let its write finish
                        snapshots = max(effort.snapshots, math.ceil((effort.min_steps + 1) / every) - 1)
                        steps = (snapshots + 1) * every - 1
                        t = time.perf_counter()
                        try:
                            ranks_out = _run({**base, "method": name, "kind": kind, "every": every, "steps": steps,
                                              "calibrate": False}, config.ranks, scratch, timeout_s)
                        except Exception as exc:
                            rows[name].setdefault("errors", []).append(f"{kind}, round {rnd}: {type(exc).__name__}: {exc}")
                            print(f"  {name} ({kind}, round {rnd}): FAILED {exc}"[:3000], file=log, flush=True)
                            continue
                        bucket = pooled[(name, kind)]
                        for r in ranks_out:
                            bucket["steps"].extend(tuple(s) for s in r["steps"][WARMUP_STEPS:])
                            bucket["writes"].extend(r["writes_seen_s"])
                        bucket["every"].append(every)
                        bucket["wall_s"].append(time.perf_counter() - t)
                        print(f"  {name} ({kind}, round {rnd}): K={every}, {steps} steps, "
                              f"{time.perf_counter() - t:.0f}s", file=log, flush=True)
            for name in runnable:
                rows[name]["kinds"] = {}
                for kind in kinds:
                    bucket = pooled[(name, kind)]
                    summary = summarize(bucket["steps"], bucket["writes"], bucket["every"])
                    summary["runs_wall_s"] = bucket["wall_s"]
                    rows[name]["kinds"][kind] = summary
            results["configs"].append({
                "label": config.label, "state_bytes": config.nbytes, "ranks": config.ranks,
                "methods": [rows[n] for n in names],
            })
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="64 MiB on 1 rank, 2 rounds")
    parser.add_argument("--smoke", action="store_true", help="the least work that runs every method (figures meaningless)")
    parser.add_argument("--sizes", nargs="*", choices=sorted(SIZES), default=None, help="states (default: by level)")
    parser.add_argument("--ranks", nargs="*", type=int, choices=(1, 2), default=None, help="gloo ranks (default: by level)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (every method once per round and step kind)")
    parser.add_argument("--snapshots", type=int, default=None, help="snapshots per run (at least; more where K is small)")
    parser.add_argument("--methods", nargs="*", default=None, help="only methods whose name contains one of these")
    parser.add_argument("--kinds", nargs="*", choices=KINDS, default=list(KINDS), help="step kinds")
    parser.add_argument("--dir", default=None, help="scratch directory's parent (default: /tmp)")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--plot", default=None, help="draw the figure into this PNG (needs matplotlib)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(json.loads(args.worker[0]))
        with open(args.worker[1], "w") as f:
            json.dump(result, f)
        return 0
    level = "smoke" if args.smoke else "quick" if args.quick else "full"
    effort = EFFORT[level]
    effort = Effort(
        tuple(args.sizes) if args.sizes else effort.sizes,
        tuple(args.ranks) if args.ranks else effort.ranks,
        args.rounds or effort.rounds,
        args.snapshots or effort.snapshots,
        effort.work,
        effort.min_steps,
    )
    results = step_during_write(effort, args.methods, tuple(args.kinds), args.dir)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from report import step_during_write_plot, step_during_write_table

    table = step_during_write_table(results)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.plot:
        step_during_write_plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
