"""Checksum throughput against memcpy, on this machine: the figures behind checksums.py's choice.

Run: .venv/bin/python benchmarks/checksum_speed.py
Each figure is the best of several repetitions over the same (warm, in-cache for the small
sizes) buffer, in GB/s (10^9 bytes per second).
"""

from __future__ import annotations

import time

import numpy as np


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    import google_crc32c
    import xxhash

    for size, label, inner in ((4096, "4 KiB", 2000), (1 << 20, "1 MiB", 50), (64 << 20, "64 MiB", 1)):
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        dst = np.empty_like(src)
        view = memoryview(src)
        arr = np.frombuffer(view, np.uint8)  # google_crc32c takes bytes or arrays, not memoryviews

        def loop(f, inner=inner):
            def run():
                for _ in range(inner):
                    f()
            return run

        cases = {
            "memcpy": loop(lambda dst=dst, src=src: np.copyto(dst, src)),
            "crc32c": loop(lambda arr=arr: google_crc32c.value(arr)),
            "xxh3_64": loop(lambda view=view: xxhash.xxh3_64_intdigest(view)),
            "xxh64": loop(lambda view=view: xxhash.xxh64_intdigest(view)),
        }
        row = []
        for name, fn in cases.items():
            t = best(fn, 7)
            row.append(f"{name} {size * inner / t / 1e9:6.2f} GB/s")
        print(f"{label:>7}: " + " | ".join(row))
    print(f"google_crc32c implementation: {google_crc32c.implementation}")


if __name__ == "__main__":
    main()
