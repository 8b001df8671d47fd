"""The markdown report: one table per state size, the hook costs, and the targets checked."""

from __future__ import annotations

from typing import Any, Callable, Optional

MiB = 1024 * 1024

TARGETS = {
    "stall": 1.5,  # async stall <= 1.5x the in-memory copy floor
    "durable_vs_peer": 1.2,  # durable <= 1.2x the fastest peer
    "durable_vs_disk": 0.6,  # durable throughput >= 60% of the disk's write bandwidth
    "hook_ns": 2000.0,  # non-saving step: <= 2 us more than a no-op callback
    "memory_async": 1.1,  # peak extra memory <= 1.1x the state (async)
    "memory_sync": 0.25,  # ... <= 0.25x (sync)
}


def _fmt_s(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x < 0.01:
        return f"{x * 1000:.2f} ms"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    return f"{x:.2f} s"


def _ratio(x: Optional[float], ref: Optional[float]) -> str:
    if x is None or not ref:
        return "-"
    return f"{x / ref:.2f}x"


def _best(rows: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in rows if r.get("peer") and r.get(key) is not None and "error" not in r]
    return min(values) if values else None


def size_table(size: dict[str, Any]) -> str:
    rows = size["methods"]
    floors = size["floors"]
    nbytes = size["state_bytes"]
    best = {k: _best(rows, k) for k in ("stall_s", "durable_s", "restore_s")}
    head = (
        "| method | stall | ×best peer | ×floor | durable | ×best peer | ×floor | write GB/s "
        "| restore | ×best peer | ×floor | peak extra memory |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        name = r["name"] if r.get("peer") else f"**{r['name']}**"
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} |" + " |" * 10)
            continue
        gbps = nbytes / r["durable_s"] / 1e9 if r.get("durable_s") else None
        mem = r.get("peak_extra_bytes")
        mem_s = f"{mem / MiB:.0f} MiB ({mem / nbytes:.2f}x)" if mem is not None else "-"
        ok = "" if r.get("restore_ok") else " (restored WRONG data)"
        lines.append(
            f"| {name}{ok} | {_fmt_s(r['stall_s'])} | {_ratio(r['stall_s'], best['stall_s'])} "
            f"| {_ratio(r['stall_s'], floors['copy_s'])} | {_fmt_s(r['durable_s'])} "
            f"| {_ratio(r['durable_s'], best['durable_s'])} | {_ratio(r['durable_s'], floors['durable_s'])} "
            f"| {gbps:.2f} | {_fmt_s(r['restore_s'])} | {_ratio(r['restore_s'], best['restore_s'])} "
            f"| {_ratio(r['restore_s'], floors['restore_s'])} | {mem_s} |"
            if gbps is not None
            else f"| {name} | - |" + " |" * 10
        )
    lines.append(
        f"| *floor: copy into preallocated buffers* | {_fmt_s(floors['copy_s'])} | | 1.00x "
        f"| | | | | | | | |"
    )
    if "state_dict_s" in floors:
        lines.append(
            f"| *reference: the model's own state_dict() call* | {_fmt_s(floors['state_dict_s'])} | "
            f"| {_ratio(floors['state_dict_s'], floors['copy_s'])} | | | | | | | | |"
        )
    lines.append(
        f"| *floor: disk sequential write + fsync* | | | | {_fmt_s(floors['durable_s'])} | | 1.00x "
        f"| {floors['disk_write_Bps'] / 1e9:.2f} | | | | |"
    )
    lines.append(
        f"| *floor: disk cold sequential read* | | | | | | | | {_fmt_s(floors['restore_s'])} | | 1.00x | |"
    )
    return head + "\n".join(lines) + "\n"


def hook_table(hooks: dict[str, dict[str, float]]) -> str:
    out = (
        "| hook on a step that does not snapshot | ns per call | ns over a no-op callback | × no-op |\n"
        "|---|---:|---:|---:|\n"
    )
    for name, v in hooks.items():
        ratio = v.get("ratio", v["per_call_ns"] / (v["per_call_ns"] - v["excess_ns"]))
        out += f"| {name} | {v['per_call_ns']:.0f} | {v['excess_ns']:.0f} | {ratio:.1f}x |\n"
    return out


def loop_table(loop: dict[str, Any]) -> str:
    sleep = f", then sleeps {loop['sleep_ms']:g} ms" if loop.get("sleep_ms") else ""
    out = (
        f"Real `torchtnt.framework.train` loops; each `train_step` writes {loop['work_mib']} MiB{sleep}. "
        f"Per-step callback dispatch ({', '.join(loop['hooks'])}), median of "
        f"{loop['rounds']} rotated rounds x {loop['steps']} steps per candidate.\n\n"
        "| hook dispatch on a step that does not snapshot (real loop) | ns per step "
        "| ns over no callback | × no-op callback | × torchtnt saver |\n"
        "|---|---:|---:|---:|---:|\n"
    )
    for name, v in loop["candidates"].items():
        def x(r: Optional[float]) -> str:
            return "-" if r is None else f"{r:.2f}x"

        out += (
            f"| {name} | {v['per_step_ns']:.0f} | {v['excess_ns']:.0f} "
            f"| {x(v['x_noop'])} | {x(v['x_torchtnt'])} |\n"
        )
    return out


def check_targets(results: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """(target, met, evidence) for this plugin's rows."""
    checks: list[tuple[str, bool, str]] = []

    def add(label: str, value: Optional[float], limit: float, ok: Callable[[float, float], bool], unit: str) -> None:
        if value is None:
            checks.append((label, False, "not measured"))
        else:
            checks.append((label, ok(value, limit), f"{value:.2f}{unit} (limit {limit:g}{unit})"))

    le = lambda v, lim: v <= lim  # noqa: E731
    ge = lambda v, lim: v >= lim  # noqa: E731
    hooks = results.get("hooks", {})
    adapter = hooks.get("tnt_snapshot_plugin TorchSnapshotSaver.on_train_step_end")
    add(
        "non-saving step: hook cost over a no-op callback",
        adapter["excess_ns"] if adapter else None, TARGETS["hook_ns"], le, " ns",
    )
    loop = results.get("loop", {}).get("candidates", {})
    plugin, tnt = loop.get("tnt_snapshot_plugin TorchSnapshotSaver"), loop.get("torchtnt TorchSnapshotSaver")
    add(
        "non-saving step in a real torchtnt loop: cost / torchtnt saver's",
        plugin["x_torchtnt"] if plugin and tnt else None, 1.0, le, "x",
    )
    for size in results["sizes"]:
        label = size["label"]
        rows = size["methods"]
        floors = size["floors"]
        nbytes = size["state_bytes"]
        best_durable = _best(rows, "durable_s")
        best_restore = _best(rows, "restore_s")
        for r in rows:
            if r.get("peer") or "error" in r or r.get("stall_s") is None:
                continue
            mode = "async" if r["async"] else "sync"
            if r["async"]:
                add(f"{label}, {mode}: stall / in-memory copy", r["stall_s"] / floors["copy_s"],
                    TARGETS["stall"], le, "x")
            if best_durable:
                add(f"{label}, {mode}: durable / fastest peer", r["durable_s"] / best_durable,
                    TARGETS["durable_vs_peer"], le, "x")
            add(f"{label}, {mode}: durable throughput / disk write bandwidth",
                nbytes / r["durable_s"] / floors["disk_write_Bps"], TARGETS["durable_vs_disk"], ge, "x")
            if best_restore:
                add(f"{label}, {mode}: restore / fastest peer", r["restore_s"] / best_restore, 1.0, le, "x")
            limit = TARGETS["memory_async"] if r["async"] else TARGETS["memory_sync"]
            add(f"{label}, {mode}: peak extra memory / state", r["peak_extra_bytes"] / nbytes, limit, le, "x")
    return checks


def markdown(results: dict[str, Any]) -> str:
    out = []
    machine = results["machine"]
    out.append(
        f"Benchmark {results['started']} on {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"Python {machine['python']}; medians of {', '.join(str(s['reps']) for s in results['sizes'])} "
        "reps after one warm-up; restores from a cold page cache; memory: "
        f"{results['memory_method']}.\n"
    )
    for size in results["sizes"]:
        out.append(f"### {size['label']} ({size['state_bytes'] / MiB:.0f} MiB)\n")
        out.append(size_table(size))
    if "hooks" in results:
        out.append("### Hook cost\n")
        out.append(hook_table(results["hooks"]))
    if "loop" in results:
        out.append("### Hook cost in a real training loop\n")
        out.append(loop_table(results["loop"]))
    out.append("### Targets (this plugin)\n")
    out.append("| target | met | measured |\n|---|---|---|\n" + "".join(
        f"| {label} | {'yes' if ok else '**no**'} | {evidence} |\n" for label, ok, evidence in check_targets(results)
    ))
    return "\n".join(out)
