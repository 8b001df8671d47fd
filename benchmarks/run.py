#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: this plugin against torchtnt, torchsnapshot, torch.save,
torch.distributed.checkpoint and Lightning, with the machine's own floors.

    python benchmarks/run.py                 # 64 MiB, 1 GiB and 10,000 x 4 KiB states
    python benchmarks/run.py --quick         # small states, one pass (< 1 minute)
    python benchmarks/run.py --smoke         # every part, on the least work (figures meaningless)
    python benchmarks/run.py --out results.json --sizes 64MiB --reps 5
    python benchmarks/run.py --sizes 10k --skip hooks loop first-stall step-during-write   # one state only

For each state size it measures, per method: the training stall per snapshot, the time until the
snapshot is durable, the restore time into preallocated tensors (cold page cache) and the peak
extra resident memory; and the floors: an in-memory copy of the state into preallocated buffers,
the disk's sequential write-with-fsync bandwidth and its cold read bandwidth. It prints a
markdown table (each figure also as a ratio to the best peer and to the floor) and writes the raw
numbers as JSON. See measure.py and methods.py for exactly what is timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import measure
import torch
from measure import FullCollections, MiB, PeakRSS, evict, median, settle_garbage
from methods import Method, select

GiB = 1024 * MiB


@dataclass(frozen=True)
class StateSpec:
    """``count`` fp32 tensors of ``shape``; ``profile``: the targets it is held to ("large"
    tensors, or "small": many small entries, report.TARGETS_SMALL); ``checksums``: also measure
    what checksums cost on it (checksum_cost.py)."""

    label: str
    count: int
    shape: tuple[int, ...]
    reps: int
    profile: str = "large"
    checksums: bool = False

    @property
    def nbytes(self) -> int:
        n = 4
        for d in self.shape:
            n *= d
        return n * self.count


FULL = [
    StateSpec("64 MiB (16 x 4 MiB)", 16, (1024, 1024), reps=5),
    StateSpec("1 GiB (64 x 16 MiB)", 64, (2048, 2048), reps=3, checksums=True),
    StateSpec("10,000 x 4 KiB", 10_000, (1024,), reps=3, profile="small", checksums=True),
]
QUICK = [
    StateSpec("8 MiB (8 x 1 MiB)", 8, (512, 512), reps=2, checksums=True),
    StateSpec("500 x 4 KiB", 500, (1024,), reps=2, profile="small", checksums=True),
]
#: --smoke: the least work that still runs every part of the run (tests/test_benchmark_smoke.py)
SMOKE = [
    StateSpec("2 MiB (2 x 1 MiB)", 2, (512, 512), reps=1, checksums=True),
    StateSpec("50 x 4 KiB", 50, (1024,), reps=1, profile="small", checksums=True),
]


@dataclass(frozen=True)
class Effort:
    """How much the parts besides the per-size tables measure: the hook cost (calls per sample,
    samples), the real loops (steps and rounds, MiB of work and ms of sleep per step), the loop
    on 2 ranks (steps, rounds), the first stall (MiB, runs) and the disk floor (bytes at least)."""

    hook_calls: int
    hook_repeats: int
    loop: tuple[int, int, int, float]
    loop_distributed: tuple[int, int, int, float]
    two_ranks: tuple[int, int]
    first_stall: tuple[int, int]
    floor_bytes: int


EFFORT = {
    "full": Effort(200_000, 9, (100, 5, 8, 20.0), (100, 3, 8, 20.0), (100, 3), (128, 3), 64 * MiB),
    "quick": Effort(20_000, 5, (40, 2, 8, 0.0), (40, 2, 8, 0.0), (20, 1), (32, 1), 64 * MiB),
    "smoke": Effort(2_000, 3, (10, 1, 1, 0.0), (10, 1, 1, 0.0), (5, 1), (4, 1), 4 * MiB),
}
#: Parts of the run besides the per-size method tables (--skip leaves them out).
EXTRAS = ("hooks", "loop", "checksums", "first-stall", "step-during-write")


def make_model(spec: StateSpec, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    for i in range(spec.count):
        model.register_parameter(
            f"p{i}", torch.nn.Parameter(torch.randn(spec.shape, generator=gen), requires_grad=False)
        )
    return model


def tensors_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.data for p in model.parameters()]


def init_process_group() -> None:
    """A single-process gloo group: torchsnapshot's async_take needs one on IPv4-only hosts
    (see NOTES: dist_store.py unpacks an IPv6 sockname), and every method then runs alike."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )


# ------------------------------------------------------------------------------------------------
# one method on one state


def save_phase(
    method: Method, model: torch.nn.Module, target: torch.nn.Module, root: str, reps: int, log: Any
) -> tuple[dict[str, Any], Optional[str], float]:
    """One warm-up and ``reps`` timed snapshots; (result row, last snapshot, its first value)."""
    first = tensors_of(model)[0]
    os.makedirs(root, exist_ok=True)
    peak = PeakRSS()
    result: dict[str, Any] = {
        "name": method.name, "peer": method.peer, "async": method.asynchronous,
        "format": method.format or None, "family": method.family or None,
    }
    stalls: list[float] = []
    durables: list[float] = []
    previous: Optional[str] = None
    last_value = 0.0
    full = FullCollections()
    started = time.perf_counter()
    try:
        method.setup(root, model, target)  # imports and framework objects: not the snapshot's
        peak.start()
        for step in range(1, reps + 2):  # step 1 is a warm-up: timed figures come from the rest
            last_value = float(step)
            first.fill_(last_value)  # the state of this step ...
            settle_garbage()
            with full:
                stall, durable, path = method.save(step)
            first.fill_(-1.0)  # ... which training mutates as soon as the save call returns
            if step > 1:
                stalls.append(stall)
                durables.append(durable)
            if previous is not None:
                method.discard(previous)
            previous = path
        result["peak_extra_bytes"] = peak.stop()
        result["snapshot_bytes"] = measure.tree_bytes(previous) if previous else 0
    except Exception as exc:  # a peer that breaks is reported, not fatal
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"  {method.name}: FAILED {result['error']}", file=log, flush=True)
        previous = None
    result.update(
        stall_s=median(stalls) if stalls else None,
        durable_s=median(durables) if durables else None,
        stall_samples=stalls,
        durable_samples=durables,
        save_wall_s=time.perf_counter() - started,
        full_gc_in_saves=full.count,  # full collections inside the timed snapshots (warm-up included)
    )
    return result, previous, last_value


def restore_once(
    method: Method, path: str, model: torch.nn.Module, target: torch.nn.Module, first_value: float
) -> tuple[float, bool, int]:
    """Restore ``path`` into ``target`` from a cold page cache; (seconds, restored exactly, full
    collections of the heap inside the timed call)."""
    with torch.no_grad():
        for t in tensors_of(target):
            t.zero_()
    evict(path)
    settle_garbage()
    with FullCollections() as full:
        t0 = time.perf_counter()
        method.restore(path)
        elapsed = time.perf_counter() - t0
    return elapsed, _check_restore(model, target, first_value), full.count


def _check_restore(model: torch.nn.Module, target: torch.nn.Module, first_value: float) -> bool:
    src = tensors_of(model)
    dst = tensors_of(target)
    if not torch.all(dst[0] == first_value):
        return False
    return all(torch.equal(a, b) for a, b in zip(src[1:], dst[1:], strict=True))


# ------------------------------------------------------------------------------------------------
# the run


def run_size(
    spec: StateSpec, methods: list[Method], workdir: str, reps: int, log: Any, checksums: bool = True,
    floor_bytes: int = 64 * MiB,
) -> dict[str, Any]:
    model = make_model(spec, seed=0)
    target = make_model(spec, seed=1)
    nbytes = spec.nbytes
    print(f"\n## {spec.label}: floors", file=log, flush=True)
    floor_copy = measure.copy_floor(tensors_of(model), reps=max(3, reps))
    floor_disk = measure.disk_floor(workdir, max(nbytes, floor_bytes), reps=max(2, min(reps, 3)))
    floors = {
        "copy_s": floor_copy["tensors_s"],
        "copy_flat_s": floor_copy["flat_s"],
        "disk_write_Bps": floor_disk["write_Bps"],
        "disk_write_buffered_fsync_Bps": floor_disk["write_buffered_fsync_Bps"],
        "disk_write_direct_Bps": floor_disk["write_direct_Bps"],
        "disk_read_Bps": floor_disk["read_cold_Bps"],
        # Not a floor of the machine but of every checkpointer: what the model's own
        # state_dict() costs, which any of them calls before it can copy anything.
        "state_dict_s": measure.median(measure.timed(model.state_dict, max(3, reps))),
    }
    floors["durable_s"] = nbytes / floors["disk_write_Bps"]
    floors["restore_s"] = nbytes / floors["disk_read_Bps"]
    print(f"  {json.dumps(floors)}", file=log, flush=True)
    rows = []
    kept: list[tuple[Method, dict[str, Any], str, float]] = []
    try:
        for i, method in enumerate(methods):
            print(f"  {method.name}: snapshots ...", file=log, flush=True)
            root = os.path.join(workdir, f"m{i}")
            row, last, first_value = save_phase(method, model, target, root, reps, log)
            row["restore_samples"] = []
            rows.append(row)
            if last is not None:
                kept.append((method, row, last, first_value))
        # Restores interleaved, method after method, each round in a rotated order: a disk whose
        # speed drifts during the run then slows every method alike.
        print(f"  restores ({reps} rounds, interleaved) ...", file=log, flush=True)
        for rep in range(reps):
            for method, row, last, first_value in kept[rep % len(kept):] + kept[: rep % len(kept)]:
                if "error" in row:
                    continue
                try:
                    elapsed, ok, full_gc = restore_once(method, last, model, target, first_value)
                except Exception as exc:
                    row["error"] = f"restore: {type(exc).__name__}: {exc}"
                    print(f"  {method.name}: FAILED {row['error']}", file=log, flush=True)
                    continue
                row["restore_samples"].append(elapsed)
                row["restore_ok"] = row.get("restore_ok", True) and ok
                row["full_gc_in_restores"] = row.get("full_gc_in_restores", 0) + full_gc
    finally:
        for method, _row, last, _ in kept:
            try:
                method.close()
                method.discard(last)
            except Exception as exc:
                print(f"  {method.name}: cleanup failed: {exc}", file=log, flush=True)
        for i in range(len(methods)):
            shutil.rmtree(os.path.join(workdir, f"m{i}"), ignore_errors=True)
    for row in rows:
        row["restore_s"] = median(row["restore_samples"]) if row["restore_samples"] else None
    size: dict[str, Any] = {
        "label": spec.label, "tensors": spec.count, "shape": list(spec.shape), "profile": spec.profile,
        "state_bytes": nbytes, "reps": reps, "floors": floors, "methods": rows,
    }
    if checksums and spec.checksums:
        from checksum_cost import checksum_cost

        # The same state, the plugin's synchronous saver with and without its checksum steps.
        print(f"  checksum cost ({reps} rounds, interleaved) ...", file=log, flush=True)
        try:
            size["checksums"] = checksum_cost(model, target, reps, workdir, log)
        except Exception as exc:
            size["checksums_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  checksum cost: FAILED {size['checksums_error']}", file=log, flush=True)
        if any(m.format == "dcp" for m in methods):
            # The same in DCP's format, when the plugin's DCP row runs.
            print(f"  checksum cost in DCP's format ({reps} rounds, interleaved) ...", file=log, flush=True)
            try:
                size["checksums_dcp"] = checksum_cost(model, target, reps, workdir, log, format="dcp")
            except Exception as exc:
                size["checksums_dcp_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  checksum cost (dcp): FAILED {size['checksums_dcp_error']}", file=log, flush=True)
    return size


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small states, 2 reps (< 1 minute)")
    parser.add_argument(
        "--smoke", action="store_true",
        help="every part on the least work (tiny states, 1 rep): checks that the run works; its "
        "figures mean nothing",
    )
    parser.add_argument("--out", default="bench-results/results.json", help="where to write the JSON")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /tmp)")
    parser.add_argument("--sizes", nargs="*", default=None, help="only states whose label contains one of these")
    parser.add_argument("--methods", nargs="*", default=None, help="only methods whose name contains one of these")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per method (after one warm-up)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch intra-op threads (default 1: on a small shared machine OpenMP's spinning "
        "threads make copies 10-100x slower whenever another process holds a core)",
    )
    parser.add_argument("--hook-calls", type=int, default=None, help="calls per hook-cost sample")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=EXTRAS,
        help="leave out these parts: the warm-loop hook cost, the real-loop hook cost, the checksum "
        "cost (per size), the first snapshot stall, the step time during a write",
    )
    args = parser.parse_args(argv)

    warnings.simplefilter("ignore")
    import logging

    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)

    level = "smoke" if args.smoke else "quick" if args.quick else "full"
    effort = EFFORT[level]
    specs = {"smoke": SMOKE, "quick": QUICK, "full": FULL}[level]
    if args.sizes:
        def squash(text: str) -> str:
            return text.lower().replace(" ", "").replace(",", "")

        def key(text: str) -> str:  # "10k" -> "10000x": the 10,000 x 4 KiB state
            text = squash(text)
            return text[:-1] + "000x" if text[:-1].isdigit() and text.endswith("k") else text

        specs = [s for s in specs if any(key(k) in squash(s.label) for k in args.sizes)]
    log = sys.stderr
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="tnt_bench_", dir=args.dir)
    results: dict[str, Any] = {
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": level != "full",
        "smoke": args.smoke,
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "scratch": workdir,
        },
        "memory_method": PeakRSS().method,
        "sizes": [],
    }
    timings: dict[str, float] = {}
    results["part_wall_s"] = timings
    try:
        if "hooks" not in args.skip:
            from hooks import hook_costs

            t = time.perf_counter()
            n = args.hook_calls or effort.hook_calls
            print("## hook cost on a non-saving step", file=log, flush=True)
            results["hooks"] = hook_costs(n=n, repeats=effort.hook_repeats)
            timings["hooks"] = time.perf_counter() - t
        if "loop" not in args.skip:
            from agreement import agreement_costs
            from loop import loop_costs

            def loops(title: str, timing: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
                """One real-loop part of the run: logged and timed."""
                t = time.perf_counter()
                print(f"## {title}", file=log, flush=True)
                try:
                    return fn()
                finally:
                    timings[timing] = time.perf_counter() - t

            results["loop"] = loops(
                "hook cost on a non-saving step in real torchtnt loops", "loop",
                lambda: loop_costs(*effort.loop),
            )
            try:
                results["loop_2ranks"] = loops(
                    "the same on 2 gloo ranks (torch.distributed, subprocesses)", "loop (2 ranks)",
                    lambda: agreement_costs(*effort.two_ranks),
                )
            except Exception as exc:
                results["loop_2ranks_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  2 ranks: FAILED {results['loop_2ranks_error']}", file=log, flush=True)
        # The hook costs above run in one process without torch.distributed, as a single-process
        # torchtnt run does. The methods need a process group (torchsnapshot's async_take on
        # IPv4-only hosts): from here on every method runs in a single-process gloo group, and
        # the real loop is measured once more in it (a saver under torch.distributed with several
        # ranks agrees on preemption with the others every few steps; in a group of one, never).
        init_process_group()
        if "loop" not in args.skip:
            results["loop_distributed"] = loops(
                "the same, under torch.distributed (a 1-rank gloo group)", "loop (torch.distributed)",
                lambda: loop_costs(*effort.loop_distributed),
            )
        for spec in specs:
            t = time.perf_counter()
            reps = args.reps or spec.reps
            results["sizes"].append(
                run_size(
                    spec, select(args.methods), workdir, reps, log,
                    checksums="checksums" not in args.skip, floor_bytes=effort.floor_bytes,
                )
            )
            timings[spec.label] = time.perf_counter() - t
        if "first-stall" not in args.skip:
            from first_stall import first_stall

            t = time.perf_counter()
            mib, runs = effort.first_stall
            print(f"## first snapshot stall ({mib} MiB, {runs} run(s) each way, fresh processes)", file=log, flush=True)
            try:
                results["first_stall"] = first_stall(mib, runs, args.dir, log)
            except Exception as exc:
                results["first_stall_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  first stall: FAILED {results['first_stall_error']}", file=log, flush=True)
            timings["first stall"] = time.perf_counter() - t
        if "step-during-write" not in args.skip:
            from step_during_write import EFFORT as SDW_EFFORT
            from step_during_write import step_during_write

            t = time.perf_counter()
            print("## step time during a write (fresh processes per method and round)", file=log, flush=True)
            try:
                results["step_during_write"] = step_during_write(SDW_EFFORT[level], workdir=workdir, log=log)
            except Exception as exc:
                results["step_during_write_error"] = f"{type(exc).__name__}: {exc}"
                print(f"  step during write: FAILED {results['step_during_write_error']}", file=log, flush=True)
            timings["step during write"] = time.perf_counter() - t
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - started

    from report import markdown, run_targets, size_targets

    for size in results["sizes"]:
        size["targets"] = size_targets(size)
    results["targets"] = [t for size in results["sizes"] for t in size["targets"]] + run_targets(results)

    table = markdown(results)
    print(table)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    print(f"\nraw numbers: {args.out}  (wall {results['wall_s']:.0f}s)", file=log)
    print("wall per part: " + ", ".join(f"{k} {v:.0f}s" for k, v in timings.items()), file=log)
    failed = [r["name"] for s in results["sizes"] for r in s["methods"] if "error" in r or not r.get("restore_ok", False)]
    if "step_during_write_error" in results:
        failed.append("step during write")
    for config in results.get("step_during_write", {}).get("configs", []):
        failed += [
            f"step during write: {r['name']} ({config['label']})" for r in config["methods"]
            if r["built"] and ("error" in r or r.get("errors") or any("error" in v for v in r.get("kinds", {}).values()))
        ]
    if failed:
        print(f"FAILED or restored wrong data: {failed}", file=log)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
