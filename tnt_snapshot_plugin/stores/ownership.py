"""Ownership of what is in a dirpath: who wrote a snapshot or holds the dirpath, and whether that
writer is provably gone.

Every write carries its writer's identity (host, pid, a per-run id): in its staging name
(:func:`staging_token`) and in the marker written first into it (``.tnt_writer.json``). A leftover
of an interrupted write is removed only when its writer is provably gone (:func:`writer_gone`:
same host and its process dead, or the pid now runs another process) or it is older than
``STALE_AFTER_S``.
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from typing import Any, Optional

from tnt_snapshot_plugin.errors import ConfigError
from tnt_snapshot_plugin.naming import is_staging_name

#: A leftover write whose writer cannot be proven gone (another host) is removed once it is older
#: than this (seconds since its writer started it): no snapshot write takes a day.
STALE_AFTER_S = 24 * 3600.0

#: How long a dirpath lease of an object store lasts without renewal (renewed every minute).
LEASE_S = 300.0

#: Run ids of the savers' runs alive in this process: a run id is added when a run starts
#: (:func:`new_run_id`) and removed when it ends (``RunGuard`` in saving/run_guard.py).
#:
#: The one process-wide registry of the stores, kept on purpose. A writer is named on the storage
#: by (host, pid, run id). Whether another process's writer is gone can be read from the system
#: (its pid dead or reused); for this process the pid is alive by definition, and whether one of
#: its runs has ended is known only to the saver that ran it. The ones that ask are never that
#: saver: another saver taking the dirpath (the leftovers it removes at train start, the S3 or
#: fsspec lease it takes over), a store deleting a staging directory whose marker was lost, a
#: restore or the command line naming who holds a snapshot or lock. Without this set each of them
#: would have to take every run of this process for alive: a second ``fit`` in the same process
#: (a notebook, a sweep) would leave the first run's leftovers for a day (``STALE_AFTER_S``), and an
#: S3 lease whose release failed would keep it out of its dirpath until the lease expired
#: (``LEASE_S``). It holds only random ids, never an object: a saver that is gone keeps nothing alive.
live_runs: set[str] = set()


def new_run_id() -> str:
    run_id = uuid.uuid4().hex[:12]
    live_runs.add(run_id)
    return run_id


def _host_hash() -> str:
    import hashlib

    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


_TOKEN = re.compile(r"(?P<run_id>[0-9a-f]{12})h(?P<host>[0-9a-f]{8})p(?P<pid>[0-9]+)n[0-9]+|del[0-9a-f]{9}")


def staging_token(run_id: str, count: int) -> str:
    """The writer's part of a staging name: run id, host (hashed), pid, and a count."""
    return f"{run_id}h{_host_hash()}p{os.getpid()}n{count}"


def writer_of_token(token: str, started_at: float) -> Optional[dict[str, Any]]:
    """The writer a staging name's token names; None if the plugin writes no such token."""
    match = _TOKEN.fullmatch(token)
    if match is None:
        return None
    if match["run_id"] is None:  # an interrupted deletion's: the process that deleted is unnamed
        return {"started_at": started_at - STALE_AFTER_S - 1.0}
    host = socket.gethostname() if match["host"] == _host_hash() else f"(hash {match['host']})"
    return {"host": host, "pid": int(match["pid"]), "run_id": match["run_id"], "started_at": started_at}


def staged_by_this_process(name: str) -> bool:
    """Whether ``name`` is a staging name of a live run of this very process (its own write, even
    where its marker was lost, e.g. the directory removed and recreated during the write)."""
    if not is_staging_name(name):
        return False
    match = _TOKEN.fullmatch(name.rsplit(".", 1)[1])
    return (
        match is not None
        and match["run_id"] in live_runs
        and match["host"] == _host_hash()
        and int(match["pid"]) == os.getpid()
    )


def writer_identity(run_id: str) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "run_id": run_id}


def _process_start_time(pid: int) -> Optional[float]:
    """When process ``pid`` started (unix seconds), from /proc; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def writer_gone(
    writer: Any, now: Optional[float] = None, stale_after: float = STALE_AFTER_S
) -> Optional[str]:
    """Why the writer of a leftover is provably gone (so the leftover may be removed), or None.

    Gone: started more than ``STALE_AFTER_S`` ago; or on this host, its pid is this process and
    its run is not one of this process's live savers, its pid is dead, or the pid now belongs to a
    process started after the write began (pid reuse).
    """
    if not isinstance(writer, dict):
        return None
    now = time.time() if now is None else now
    started = writer.get("started_at")
    if isinstance(started, (int, float)) and now - started > stale_after:
        return f"started {now - started:.0f}s ago (more than {stale_after:.0f}s)"
    pid = writer.get("pid")
    if writer.get("host") != socket.gethostname() or isinstance(pid, bool) or not isinstance(pid, int):
        return None
    if pid == os.getpid():
        return None if writer.get("run_id") in live_runs else "its run in this process has ended"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its process {pid} is dead"
    except OSError:  # exists (owned by someone else)
        pass
    begun = _process_start_time(pid)
    if begun is not None and isinstance(started, (int, float)) and begun > started + 1.0:
        return f"pid {pid} now belongs to a process started after the write began"
    return None


def lease_held_by_another(lease: dict[str, Any], run_id: Any) -> bool:
    """Whether the lease record ``lease`` keeps a saver of run ``run_id`` out of its dirpath:
    another run's, not expired, and its writer not provably gone."""
    return (
        lease.get("run_id") != run_id
        and isinstance(lease.get("expires_at"), (int, float))
        and lease["expires_at"] > time.time()
        and writer_gone(lease, stale_after=float("inf")) is None
    )


def holder_text(holder: Any) -> str:
    """Who holds a lock or lease (``holder``: its record), for messages."""
    if not isinstance(holder, dict):
        return "an unknown process"
    since = holder.get("started_at")
    when = (
        time.strftime(" since %Y-%m-%d %H:%M:%S UTC", time.gmtime(since))
        if isinstance(since, (int, float))
        else ""
    )
    return f"host {holder.get('host')!r} pid {holder.get('pid')} run {holder.get('run_id')!r}{when}"


def hold_lost(what: str) -> str:
    """The message for a run that no longer holds its dirpath (``what`` happened to its lock or
    lease): raised at each of its later snapshots (``DirLock.check``)."""
    return (
        f"{what}: this run no longer holds the dirpath and commits no more snapshots into it "
        "(two runs in one dirpath would replace and delete each other's snapshots); start the "
        "run again to take the dirpath anew, or give each job its own dirpath"
    )


def busy_error(url: str, holder: Any) -> ConfigError:
    """The error for a dirpath held by another saver (``holder``: its lock's or lease's record)."""
    return ConfigError(
        f"dirpath {url!r} is in use by another saver ({holder_text(holder)}): two jobs writing "
        "one dirpath would mix their snapshots and delete each other's. Give each job its own "
        "dirpath, or stop the other job first"
    )
