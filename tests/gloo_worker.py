"""What every multi-process test worker does around its own work: join a gloo process group
through a FileStore, run, and leave a JSON record of what it saw for the test to assert on.

Imports torch.distributed only (never the plugin): tests/stock_reader.py, which must run stock
torchsnapshot in processes that never import the plugin, uses it too.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

import torch.distributed as dist


def run_rank(
    rank: int,
    world: int,
    rendezvous: str,
    record_path: str,
    body: Callable[[dict[str, Any]], None],
    *,
    backend: str = "gloo",
    timeout_s: float = 120,
) -> NoReturn:
    """Join the group (``rendezvous``: a FileStore path that must not exist yet; no port to pick,
    none to collide; gloo on the loopback interface only), run ``body(record)``, write ``record``
    (with ``rank``, ``ok``, ``seconds`` and, on a failure, ``traceback``) to ``record_path`` and
    exit: status 0 when ``body`` returned, 1 when it raised."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend,
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    record: dict[str, Any] = {"rank": rank}
    started = time.perf_counter()
    try:
        body(record)
        record["ok"] = True
    except BaseException:
        record["ok"] = False
        record["traceback"] = traceback.format_exc()
    record["seconds"] = time.perf_counter() - started
    with open(record_path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    if record["ok"]:  # a failed rank's peers may be stuck in a collective: do not wait for them
        dist.destroy_process_group()
    sys.exit(0 if record["ok"] else 1)
