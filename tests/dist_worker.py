"""One rank of the 2-process gloo tests in tests/test_distributed.py.

Run by the tests as ``python tests/dist_worker.py SCENARIO RANK WORLD_SIZE RENDEZVOUS OUTDIR``,
one process per rank; they meet through a FileStore at RENDEZVOUS (a path that must not exist
yet) and gloo connects them over the loopback interface only (127.0.0.1). Each scenario runs several phases in one process group (process
start-up costs seconds) and writes what it observed to ``OUTDIR/rank{RANK}.json``; the test
asserts on those records, so a failed expectation shows up there with the rank that saw it.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
import random
import sys
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from gloo_worker import run_rank
from torch.nn.parallel import DistributedDataParallel
from torchtnt.framework.train import train

from tnt_snapshot_plugin import SnapshotError, SnapshotFailedWarning, SnapshotWriteError
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.distributed import Collectives, raise_if_any_failed
from tnt_snapshot_plugin.stores import LocalStore
from tnt_snapshot_plugin.testing import FaultyStore, register
from toy import StatefulLoader, ToyUnit, make_data, seed_everything, weights

#: The name the training process group's backend is registered under: a gloo process group
#: that torch.distributed does not know as "gloo", standing in for NCCL on this CPU-only machine.
TRAINING_BACKEND = "trainingbackend"
STEPS_PER_EPOCH = 5


class DDPUnit(ToyUnit):
    """ToyUnit with its model wrapped in DistributedDataParallel (gradients averaged)."""

    def __init__(self, seed: int = 0, fail_at_step: Any = None) -> None:
        super().__init__(seed=seed, fail_at_step=fail_at_step)
        self.model = DistributedDataParallel(self.model)


def loader(rank: int) -> StatefulLoader:
    """Each rank has its own data shard and shuffle order; 5 batches per epoch."""
    return StatefulLoader(make_data(4 * STEPS_PER_EPOCH, seed=rank), seed=10 * rank)


def rng_digest() -> dict[str, str]:
    """A fingerprint of every generator the snapshot restores."""
    np_state = np.random.get_state()
    return {
        "torch": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python": hashlib.sha256(repr(random.getstate()).encode()).hexdigest(),
        "numpy": hashlib.sha256(np_state[1].tobytes() + repr(np_state[2:]).encode()).hexdigest(),
    }


def weights_digest(unit: ToyUnit) -> str:
    h = hashlib.sha256()
    for key, value in sorted(weights(unit).items()):
        h.update(key.encode())
        h.update(value.numpy().tobytes())
    return h.hexdigest()


def list_tree(root: str) -> dict[str, int]:
    """Relative path -> size of every file under ``root``."""
    out = {}
    for parent, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(parent, name)
            out[os.path.relpath(path, root)] = os.path.getsize(path)
    return out


def manifest_of(path: str) -> dict[str, dict[str, Any]]:
    """``rank/logical_path`` -> entry type, replicated flag and storage location."""
    from torchsnapshot import Snapshot

    out: dict[str, dict[str, Any]] = {}
    for key, entry in Snapshot(path).metadata.manifest.items():
        out[key] = {
            "type": type(entry).__name__,
            "replicated": bool(getattr(entry, "replicated", False)),
            "location": getattr(entry, "location", None),
            "byte_range": getattr(entry, "byte_range", None),
        }
    return out


class CaptureSaver(TorchSnapshotSaver):
    """Records every rank's RNG fingerprint and weights at the step it is told to watch."""

    def __init__(self, *args: Any, capture_step: int = -1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_step = capture_step
        self.captured: dict[str, Any] = {}

    def on_train_step_end(self, state: Any, unit: Any) -> None:
        if unit.train_progress.num_steps_completed == self.capture_step:
            self.captured = {
                "rng": rng_digest(),
                "weights": weights_digest(unit),
                "holds_lock": self.snapshotter.guard.lock is not None,
                "lock_file": os.path.exists(os.path.join(self.dirpath, ".tnt_snapshot.lock")),
            }
        super().on_train_step_end(state, unit)


class WarningLog(logging.Handler):
    """Collects the warnings a library logs (torchsnapshot logs, it does not warn)."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger(logger_name).addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ------------------------------------------------------------------------------------------------
# Scenarios


def scenario_ddp(rank: int, out: str, record: dict[str, Any]) -> None:
    """DDP + replicated=["**"] through the torchtnt adapter, training on a non-"gloo" backend."""
    record["default_backend"] = str(dist.get_backend())
    torchsnapshot_warnings = WarningLog("torchsnapshot")

    # 1. The constructor broadcasts rank 0's dirpath; snapshots are written there only.
    run_dirs = [os.path.join(out, f"run_rank{r}") for r in range(2)]
    unit = DDPUnit(seed=0)
    seed_everything(100 + rank)  # every rank draws different dropout masks / random / numpy
    saver = CaptureSaver(
        run_dirs[rank],
        save_every_n_train_steps=2,
        save_every_n_epochs=1,
        replicated=["**"],
        collective_timeout_s=30,
        capture_step=4,
    )
    group = saver.snapshotter.collectives.group
    record["dirpath"] = saver.dirpath
    record["saver_group_backend"] = str(dist.get_backend(group))
    record["saver_group_is_world"] = group is dist.group.WORLD
    record["saver_group_ranks"] = dist.get_process_group_ranks(group)
    train(unit, loader(rank), max_epochs=2, callbacks=[saver])
    saver.snapshotter.wait()
    record["captured"] = saver.captured
    record["final_weights"] = weights_digest(unit)
    dist.barrier()
    if rank == 0:
        record["run_dirs"] = {r: sorted(os.listdir(d)) if os.path.isdir(d) else None for r, d in enumerate(run_dirs)}
        snap = os.path.join(run_dirs[0], "epoch_0_step_4")
        record["manifest"] = manifest_of(snap)
        record["files"] = list_tree(snap)

    # 2. The same training state saved without replicated: the baseline for the size check.
    baseline = TorchSnapshotSaver(
        os.path.join(out, "baseline"), async_snapshot=False, collective_timeout_s=30
    )
    baseline.snapshotter.save(0, 4, {"model": unit.model, "optimizer": unit.optimizer})
    dist.barrier()
    if rank == 0:
        record["baseline_files"] = list_tree(os.path.join(out, "baseline", "epoch_0_step_4"))
        record["baseline_manifest"] = manifest_of(os.path.join(out, "baseline", "epoch_0_step_4"))

    # 3. Restore a mid-epoch snapshot into fresh units: each rank gets its own RNG state back.
    fresh = DDPUnit(seed=50 + rank)
    seed_everything(999)  # the same on both ranks: whatever differs afterwards came from the snapshot
    TorchSnapshotSaver.restore(
        os.path.join(saver.dirpath, "epoch_0_step_4"), fresh, train_dataloader=loader(rank)
    )
    record["restored"] = {
        "rng": rng_digest(),
        "weights": weights_digest(fresh),
        "steps": fresh.train_progress.num_steps_completed,
        "epochs": fresh.train_progress.num_epochs_completed,
    }

    # 4. Resume equivalence: interrupted at step 7 (mid-epoch 2), resumed from the latest
    #    snapshot in fresh units with other seeds, ends bitwise equal to an uninterrupted run.
    def fresh_run(fail_at_step: Any = None) -> DDPUnit:
        u = DDPUnit(seed=0, fail_at_step=fail_at_step)
        seed_everything(7 + rank)
        return u

    reference = fresh_run()
    train(reference, loader(rank), max_epochs=2)
    record["reference_weights"] = weights_digest(reference)

    resume_dir = os.path.join(out, "resume")
    interrupted = fresh_run(fail_at_step=7)
    saver = TorchSnapshotSaver(
        resume_dir, save_every_n_train_steps=2, replicated=["**"], collective_timeout_s=30
    )
    try:
        train(interrupted, loader(rank), max_epochs=2, callbacks=[saver])
        record["interrupted_error"] = None
    except RuntimeError as exc:
        record["interrupted_error"] = str(exc)
    resumed = DDPUnit(seed=321 + rank)
    seed_everything(5)
    resumed_loader = loader(rank)
    record["resume_found"] = TorchSnapshotSaver.restore_from_latest(
        resume_dir, resumed, train_dataloader=resumed_loader
    )
    record["resumed_from_step"] = resumed.train_progress.num_steps_completed
    train(resumed, resumed_loader, max_epochs=2)
    record["resumed_weights"] = weights_digest(resumed)
    record["torchsnapshot_warnings"] = torchsnapshot_warnings.messages
    wall_clock_phase(rank, out, record)
    agreement_phase(rank, out, record)


def agreement_phase(rank: int, out: str, record: dict[str, Any]) -> None:
    """The preemption agreement runs every few steps, as many as rank 0's step time says.

    Rank 0's (fake) clock reads 1/16 s more at each step, so it asks for an agreement every
    AGREE_EVERY_S / (1/16 s) = 4 steps once it has measured a step (the first agreements come at
    steps 1, 2 and 3). Rank 1 alone receives SIGUSR1 during step 10: its vote goes into the
    agreement of step 11, whose answer every rank reads at step 15, and both snapshot step 15.
    """
    import signal

    from tnt_snapshot_plugin import distributed
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    assert distributed.AGREE_EVERY_S == 0.25
    now = [0.0]
    polls: list[int] = []
    real_poll = distributed.AgreedFlag.poll

    def counted(self: Any, local: int, step: int) -> int:
        polls.append(step)
        return real_poll(self, local, step)

    distributed.AgreedFlag.poll = counted  # type: ignore[method-assign]
    preempted: list[int] = []
    step = 0
    config = SnapshotConfig.build(
        save_every_n_train_steps=1000,
        async_snapshot=False,
        save_on_train_end=False,
        preemption_signals=[signal.SIGUSR1],
        collective_timeout_s=30,
    )
    snapshotter = Snapshotter(
        os.path.join(out, "agreement"), config, clock=lambda: now[0], on_preempted=lambda signum: preempted.append(step)
    )
    model = torch.nn.Linear(2, 2)
    try:
        snapshotter.train_start(["model"])
        for step in range(1, 40):
            now[0] += 1 / 16
            if rank == 1 and step == 10:
                os.kill(os.getpid(), signal.SIGUSR1)
            snapshotter.step_end(0, step, lambda intra_epoch: {"model": model})
            if preempted:
                break
        snapshotter.train_end(0, step, lambda intra_epoch: {"model": model})
    finally:
        distributed.AgreedFlag.poll = real_poll  # type: ignore[method-assign]
    record["agreement"] = {
        "polls": polls,
        "preempted_at": preempted,
        "committed": [r.step for r in snapshotter.stats.committed],
    }
    # the records went to rank 0 alone; every rank hears the bytes all ranks wrote
    record["agreement_snapshot"] = [(r.path, r.bytes_written) for r in snapshotter.stats.committed]


def wall_clock_phase(rank: int, out: str, record: dict[str, Any]) -> None:
    """The wall-clock cadence: rank 0's (fake) clock decides, both ranks snapshot at one step.

    Rank 0's clock reads 4 s more at each step; rank 1's must never be read. The interval (10 s)
    elapses at steps 3 and 7 (the clock restarts at the snapshot of step 4): the agreement's
    answer arrives one step later, so both ranks snapshot steps 4 and 8.
    """
    from tnt_snapshot_plugin.config import SnapshotConfig
    from tnt_snapshot_plugin.saving.saver import Snapshotter

    now = [0.0]

    def rank1_clock() -> float:
        raise AssertionError("rank 1 read its clock; only rank 0's decides")

    config = SnapshotConfig.build(
        save_every_n_seconds=10,
        async_snapshot=False,
        save_on_train_end=False,
        preemption_signals=[],  # the cadence's votes then get an agreement of their own
        collective_timeout_s=30,
    )
    snapshotter = Snapshotter(
        os.path.join(out, "timed"), config, clock=(lambda: now[0]) if rank == 0 else rank1_clock
    )
    model = torch.nn.Linear(2, 2)
    snapshotter.train_start(["model"])
    for step in range(1, 9):
        now[0] += 4.0
        snapshotter.step_end(0, step, lambda intra_epoch: {"model": model})
    snapshotter.train_end(0, 8, lambda intra_epoch: {"model": model})
    record["wall_clock_steps"] = [r.step for r in snapshotter.stats.committed]


def scenario_failure(rank: int, out: str, record: dict[str, Any]) -> None:
    """A write error on rank 1 only: every rank hears of it, nothing is committed, older intact.

    Every rank saves to ``fake://warn`` / ``fake://raise``: a FaultyStore around the real local
    directory (registered in each rank's own process, so both ranks pass the same dirpath); on
    rank 1 only, its payload writes of step 4 raise ENOSPC."""

    def faulty_dir(name: str, path: str) -> str:
        faulty = FaultyStore(LocalStore(path))
        if rank == 1:
            faulty.inject(
                "write_payload",
                OSError(28, "No space left on device (injected on rank 1)"),
                times=None,
                match=lambda staging, rel: "epoch_0_step_4" in staging,
            )
        return register(name, faulty)

    # 1. on_save_error="warn": training goes on, every rank warns, step 2 stays the newest.
    warn_dir = os.path.join(out, "warn")
    unit = ToyUnit(seed=0)
    saver = TorchSnapshotSaver(
        faulty_dir("warn", warn_dir), save_every_n_train_steps=2, save_on_train_end=False, collective_timeout_s=30
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, loader(rank), max_epochs=1, callbacks=[saver])
    record["warn"] = {
        "failed_warnings": [str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)],
        "steps": unit.train_progress.num_steps_completed,
        "failures": saver.snapshotter.stats.failures,
    }
    dist.barrier()
    if rank == 0:
        record["warn"]["dir"] = sorted(os.listdir(warn_dir))
    fresh = ToyUnit(seed=9)
    record["warn"]["latest_restored"] = TorchSnapshotSaver.restore_from_latest(warn_dir, fresh)
    record["warn"]["latest_steps"] = fresh.train_progress.num_steps_completed

    # 2. on_save_error="raise": every rank raises SnapshotWriteError at its next hook.
    raise_dir = os.path.join(out, "raise")
    unit = ToyUnit(seed=0)
    saver = TorchSnapshotSaver(
        faulty_dir("raise", raise_dir),
        save_every_n_train_steps=2,
        on_save_error="raise",
        save_on_train_end=False,
        collective_timeout_s=30,
    )
    try:
        train(unit, loader(rank), max_epochs=1, callbacks=[saver])
        record["raise"] = {"error": None}
    except SnapshotWriteError as exc:
        record["raise"] = {"error": "SnapshotWriteError", "message": str(exc)}
    dist.barrier()
    if rank == 0:
        record["raise"]["dir"] = sorted(os.listdir(raise_dir))

    # 2b. Rank 1 fails and rank 0 fails only as a consequence (a collective that lost its
    #     peer): every rank reports rank 1's error, not rank 0's.
    coll = Collectives.create(None, 30)
    try:
        mine: BaseException = (
            OSError(28, "No space left on device (injected on rank 1)")
            if rank == 1
            else coll.failed("gather", RuntimeError("Connection closed by peer"))
        )
        raise_if_any_failed(coll, mine, "writing snapshot epoch_0_step_4")
        record["verdict"] = {"error": None}
    except Exception as exc:
        record["verdict"] = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        coll.close()

    # 3. Rank 1 fails outside the write (its state_dict raises) and leaves training while rank 0
    #    goes on: rank 0 must fail within the collective timeout, with a typed error.
    crash_dir = os.path.join(out, "crash")
    # Rank 0's steps take 0.3 s, over AGREE_EVERY_S: its ranks agree on preemption at every step,
    # and the first agreement rank 1 misses fails after the timeout.
    unit = ToyUnit(seed=0) if rank == 1 else SlowUnit(seed=0)
    if rank == 1:
        unit.broken = BrokenState()
    saver = TorchSnapshotSaver(
        crash_dir, save_every_n_train_steps=2, save_on_train_end=False, collective_timeout_s=CRASH_TIMEOUT_S
    )
    started = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(unit, loader(rank), max_epochs=1, callbacks=[saver])
        record["crash"] = {"error": None}
    except Exception as exc:
        record["crash"] = {
            "error": type(exc).__name__,
            "message": str(exc),
            "is_snapshot_error": isinstance(exc, SnapshotError),
        }
    record["crash"]["seconds"] = time.perf_counter() - started
    record["crash"]["failed_warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, SnapshotFailedWarning)
    ]
    dist.barrier()  # on the default group: rank 1 stays up until rank 0 has given up
    if rank == 0:
        record["crash"]["dir"] = sorted(os.listdir(crash_dir))


CRASH_TIMEOUT_S = 5


class SlowUnit(ToyUnit):
    def train_step(self, state: Any, data: Any) -> None:
        time.sleep(0.3)
        super().train_step(state, data)


class BrokenState:
    """A stateful attribute whose state cannot be taken."""

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("state_dict failed (injected on rank 1)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def scenario_idiom(rank: int, out: str, record: dict[str, Any]) -> None:
    """torchtnt's DDP idiom: rank 0 passes the directory, the other ranks pass ""."""
    run = os.path.join(out, "run")
    mine = run if rank == 0 else ""
    unit = DDPUnit(seed=0)
    saver = TorchSnapshotSaver(mine, save_every_n_train_steps=2, collective_timeout_s=30)
    record["dirpath"] = saver.dirpath
    train(unit, loader(rank), max_epochs=1, callbacks=[saver])
    record["weights"] = weights_digest(unit)
    dist.barrier()
    if rank == 0:
        record["names"] = sorted(n for n in os.listdir(run) if not n.startswith("."))

    fresh = DDPUnit(seed=10 + rank)
    record["latest_found"] = TorchSnapshotSaver.restore_from_latest(mine, fresh, collective_timeout_s=30)
    record["latest_weights"] = weights_digest(fresh)
    chosen = DDPUnit(seed=20 + rank)
    TorchSnapshotSaver.restore(
        os.path.join(run, "epoch_0_step_4") if rank == 0 else "", chosen, collective_timeout_s=30
    )
    record["restored_steps"] = chosen.train_progress.num_steps_completed

    best_k_phase(rank, out, record)

    # A bad dirpath on rank 0 raises on every rank at once (not after collective_timeout_s).
    a_file = os.path.join(out, "a_file")
    if rank == 0:
        with open(a_file, "w") as f:
            f.write("not a directory")
    dist.barrier()
    bad = {"a_file": a_file, "under_a_file": os.path.join(a_file, "sub"), "empty": ""}
    record["bad_saver"] = {}
    record["bad_restore"] = {}
    for case, path in bad.items():
        given = path if rank == 0 else ""
        try:
            TorchSnapshotSaver(given, collective_timeout_s=30)
            record["bad_saver"][case] = None
        except Exception as exc:
            record["bad_saver"][case] = f"{type(exc).__name__}: {exc}"
        try:
            TorchSnapshotSaver.restore_from_latest(given, DDPUnit(), collective_timeout_s=30)
            record["bad_restore"][case] = None
        except Exception as exc:
            record["bad_restore"][case] = f"{type(exc).__name__}: {exc}"
        dist.barrier()


class ScoredDDPUnit(DDPUnit):
    """Sets ``val_metric`` after each step; the ranks' values differ (rank 0's names snapshots)."""

    VALUES = [0.5, 0.2, 0.4, 0.3, 0.6]

    def train_step(self, state: Any, data: Any) -> None:
        super().train_step(state, data)
        self.val_metric = self.VALUES[self.train_progress.num_steps_completed] + 10 * dist.get_rank()


def best_k_phase(rank: int, out: str, record: dict[str, Any]) -> None:
    """best_checkpoint_config under DDP with the idiom: rank 0's metric names the snapshots,
    both ranks agree, and restore_from_best("") on rank 1 restores rank 0's pick."""
    from torchtnt.utils.checkpoint import BestCheckpointConfig

    best = os.path.join(out, "best")
    saver = TorchSnapshotSaver(
        best if rank == 0 else "",
        save_every_n_train_steps=1,
        keep_last_n_checkpoints=1,
        best_checkpoint_config=BestCheckpointConfig("val_metric", "min"),
        collective_timeout_s=30,
    )
    train(ScoredDDPUnit(seed=0), loader(rank), max_epochs=1, callbacks=[saver])
    dist.barrier()
    if rank == 0:
        record["best_names"] = sorted(n for n in os.listdir(best) if not n.startswith("."))
    fresh = ScoredDDPUnit(seed=30 + rank)
    record["best_found"] = TorchSnapshotSaver.restore_from_best(
        best if rank == 0 else "", fresh, "val_metric", "min", collective_timeout_s=30
    )
    record["best_steps"] = fresh.train_progress.num_steps_completed


def scenario_checksum(rank: int, out: str, record: dict[str, Any]) -> None:
    """A byte flipped in rank 1's file of the newest snapshot: both ranks fall back together."""
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore_from_latest
    from tnt_snapshot_plugin.distributed import Collectives
    from toy import Holder

    def state(step: int) -> dict[str, Any]:  # per rank: nothing replicated
        return {"w": torch.full((50_000,), float(100 * rank + step)), "s": [torch.full((8,), float(step + i)) for i in range(4)]}

    dirpath = os.path.join(out, "run")
    saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False, collective_timeout_s=30))
    saver.train_start(["a", "b"], 0, 0)
    rngs = {}
    for step in (1, 2):
        seed_everything(1000 * step + rank)
        rngs[step] = rng_digest()
        saver.save(0, step, {"a": Holder(state(step)), "b": Holder(state(step))})
    saver.train_end(0, 2, lambda intra_epoch: {})
    newest = os.path.join(dirpath, "epoch_0_step_2")
    if rank == 1:
        entry = manifest_of(newest)["1/b/w"]
        file = os.path.join(newest, entry["location"])
        start, end = entry["byte_range"] or (0, os.path.getsize(file))
        with open(file, "r+b") as f:
            f.seek((start + end) // 2)
            byte = f.read(1)
            f.seek((start + end) // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
        record["flipped"] = entry["location"]
    dist.barrier()
    zero = {"w": torch.zeros(50_000), "s": [torch.zeros(8) for _ in range(4)]}
    a, b = Holder(zero), Holder({"w": torch.zeros(50_000), "s": [torch.zeros(8) for _ in range(4)]})
    with warnings.catch_warnings(record=True) as caught, Collectives.create(None, 30, for_restore=True) as coll:
        warnings.simplefilter("always")
        record["restored"] = restore_from_latest(dirpath, {"a": a, "b": b}, collectives=coll)
    record["warnings"] = [str(w.message) for w in caught]
    want = state(1)
    record["values_of_step_1"] = all(
        torch.equal(h.state["w"], want["w"]) and all(torch.equal(x, y) for x, y in zip(h.state["s"], want["s"], strict=True))
        for h in (a, b)
    )
    record["rng_of_step_1"] = rng_digest() == rngs[1]


class FailsToLoad:
    """A user's stateful whose ``load_state_dict`` raises (on the rank that restores into it)."""

    def __init__(self) -> None:
        self.state = {"x": torch.zeros(8)}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise ValueError("this rank's own load_state_dict failed")


def scenario_own_error(rank: int, out: str, record: dict[str, Any]) -> None:
    """Rank 1's own ``load_state_dict`` fails while rank 0 loads everything: both ranks raise
    (rank 0 a DistributedError naming rank 1's error), and neither trains on."""
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter, restore_from_latest
    from tnt_snapshot_plugin.distributed import Collectives
    from toy import Holder

    dirpath = os.path.join(out, "run")
    saver = Snapshotter(dirpath, SnapshotConfig.build(async_snapshot=False, collective_timeout_s=30))
    saver.train_start(["a", "b"], 0, 0)
    saver.save(0, 1, {"a": Holder({"w": torch.full((16,), 1.0)}), "b": Holder({"x": torch.ones(8)})})
    saver.train_end(0, 1, lambda intra_epoch: {})
    a = Holder({"w": torch.zeros(16)})
    b = FailsToLoad() if rank == 1 else Holder({"x": torch.zeros(8)})
    with Collectives.create(None, 30, for_restore=True) as coll:
        try:
            record["restored"] = restore_from_latest(dirpath, {"a": a, "b": b}, collectives=coll)
        except Exception as exc:
            record["error"] = type(exc).__name__
            record["message"] = str(exc)
        record["after"] = coll.all_gather(rank)  # both ranks still meet: neither was left waiting


SCENARIOS: dict[str, Callable[[int, str, dict[str, Any]], None]] = {
    "ddp": scenario_ddp,
    "failure": scenario_failure,
    "idiom": scenario_idiom,
    "checksum": scenario_checksum,
    "own_error": scenario_own_error,
}


def main() -> None:
    scenario, rank_s, world_s, rendezvous, out = sys.argv[1:6]
    rank, world = int(rank_s), int(world_s)
    backend = "gloo"
    if scenario == "ddp":

        def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
            return dist.ProcessGroupGloo(store, rank, size, timeout)

        dist.Backend.register_backend(TRAINING_BACKEND, create, devices=["cpu"])
        backend = TRAINING_BACKEND
    run_rank(
        rank, world, rendezvous, os.path.join(out, f"rank{rank}.json"),
        lambda record: SCENARIOS[scenario](rank, out, record), backend=backend,
    )


if __name__ == "__main__":
    main()
