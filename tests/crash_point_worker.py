"""Fork server for tests/test_crash_points.py: one torchtnt run per request, killed (SIGKILL, by
itself) right before an exact storage operation.

The server imports torch, torchtnt, boto3 and fsspec once, starts no threads and runs no torch
kernels; each request forks a fresh child, so every run and every check is a process of its own
that merely skipped the imports.

The scenario, on a local path, an ``s3://`` URL (the plugin's S3 store) or an ``s3a://`` URL (the
fsspec store over s3fs), both S3 ones against moto's server:

* ``setup``: ToyUnit trains one step with the saver: dirpath holds ``epoch_0_step_1``, the
  previous snapshot.
* ``save``: restores it, then, with the tracer armed, a new saver (``keep_last_n_snapshots=1``)
  trains step 2: train start (the dirpath's lock or lease, leftovers), the snapshot
  ``epoch_0_step_2``, its commit, the retention deleting ``epoch_0_step_1``, train end. The tracer
  sees every operation on the storage: on local disk the system calls that change state (open
  for writing, write, writev, pwrite, ftruncate, fsync, fdatasync, mkdir, rename, unlink, rmdir),
  on S3 every HTTP request (botocore's ``before-send``), through fsspec every call of fsspec's
  API on the filesystem object. It wraps what the plugin calls (``os``, botocore, the fsspec
  instance), never the plugin's own functions. The result lists them in order, ``[kind, target, n, nbytes]`` each (the
  n-th of that kind on that target; staging tokens and random ids in paths read ``<token>``,
  ``<id>``). With ``kill`` (``{"key": [kind, target, n], "mid": bool}``) the run SIGKILLs
  itself right before that operation, or (``mid``) after writing the first half of that
  write's bytes.
* ``check``: a fresh process lists and verifies what restore could pick, restores the latest
  snapshot, then trains one more step with a saver (the next run), and restores what that run
  committed.
* ``reference``: ToyUnit trains three steps without a saver: each step's fingerprint.

A fingerprint holds digests of the unit's model, optimizer, LR scheduler, progress, loader
state and RNGs (torch, Python, numpy): equal digests are bitwise equal states.

Protocol: one JSON object per line; the test writes a request on stdin and reads exactly one
reply on stdout: ``{"signal": N or null, "exit_code": N or null, "result": {...} or null,
"error": traceback or null}``. The server writes it once the child has ended; a child still
running after the request's ``timeout_s`` (default 120) is killed, and the reply says so.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import json
import os
import random
import re
import select
import signal
import sys
import threading
import time
import traceback
import urllib.parse
import warnings
from typing import Any, Callable, Optional

warnings.filterwarnings("ignore", message="pkg_resources is deprecated")

import boto3  # noqa: E402, F401  (imported before the fork, not in every child)
import botocore.session  # noqa: E402
import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import s3fs  # noqa: E402, F401
import torch  # noqa: E402
import torch._dynamo  # noqa: E402, F401  (what an optimizer's constructor imports: 0.7 s a child otherwise)
from torchtnt.framework.callback import Callback  # noqa: E402
from torchtnt.framework.train import train  # noqa: E402

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver  # noqa: E402
from tnt_snapshot_plugin.format import listing, verify  # noqa: E402
from tnt_snapshot_plugin.stores import open_store  # noqa: E402
from tnt_snapshot_plugin.stores import s3 as s3_store  # noqa: E402
from toy import StatefulLoader, ToyUnit, make_data, seed_everything  # noqa: E402

KEEP_LAST = 1
#: What the runs import on first use: imported by the server once, not by each child.
for _module in ("adapters.plugins", "format.torchsnapshot.inflate",
                "format.torchsnapshot.reader", "format.torchsnapshot.targets",
                "metrics", "restoring"):
    importlib.import_module(f"tnt_snapshot_plugin.{_module}")
_write = os.write  # the worker's own replies: never traced


# ------------------------------------------------------------------------------------------------
# The training runs.


def digest(value: Any) -> str:
    h = hashlib.sha256()

    def feed(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"tensor {t.dtype} {tuple(t.shape)}:".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(v, np.ndarray):
            h.update(f"array {v.dtype} {v.shape}:".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif isinstance(v, dict):
            h.update(b"{")
            for key in sorted(v, key=repr):
                feed(key)
                feed(v[key])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for item in v:
                feed(item)
            h.update(b"]")
        else:
            h.update(f"{type(v).__name__} {v!r};".encode())

    feed(value)
    return h.hexdigest()[:20]


def fingerprint(unit: ToyUnit, loader: StatefulLoader) -> dict[str, Any]:
    return {
        "step": unit.train_progress.num_steps_completed,
        "model": digest(unit.model.state_dict()),
        "optimizer": digest(unit.optimizer.state_dict()),
        "lr_scheduler": digest(unit.lr_scheduler.state_dict()),
        "progress": digest(unit.train_progress.state_dict()),
        "loader": digest(loader.state_dict()),
        "rng": digest([torch.get_rng_state(), random.getstate(), np.random.get_state()]),
    }


class Record(Callback):
    """Each step's fingerprint (placed after the saver: the state it snapshots)."""

    def __init__(self, loader: StatefulLoader) -> None:
        self.loader = loader
        self.steps: dict[int, dict[str, Any]] = {}

    def on_train_step_end(self, state: Any, unit: ToyUnit) -> None:
        self.steps[unit.train_progress.num_steps_completed] = fingerprint(unit, self.loader)


def fresh() -> tuple[ToyUnit, StatefulLoader]:
    seed_everything(7)
    return ToyUnit(seed=0), StatefulLoader(make_data(16), seed=3)


def saver(dirpath: str, options: Optional[dict[str, Any]]) -> TorchSnapshotSaver:
    return TorchSnapshotSaver(
        dirpath,
        save_every_n_train_steps=1,
        keep_last_n_snapshots=KEEP_LAST,
        save_on_train_end=False,
        storage_options=options,
    )


def restore(dirpath: str, options: Optional[dict[str, Any]], unit: ToyUnit, loader: StatefulLoader) -> bool:
    return TorchSnapshotSaver.restore_from_latest(dirpath, unit, train_dataloader=loader, storage_options=options)


def run_reference(request: dict[str, Any]) -> dict[str, Any]:
    unit, loader = fresh()
    record = Record(loader)
    train(unit, loader, max_steps=3, callbacks=[record])
    return {"steps": record.steps}


def run_setup(request: dict[str, Any]) -> dict[str, Any]:
    unit, loader = fresh()
    record = Record(loader)
    train(unit, loader, max_steps=1, callbacks=[saver(request["dirpath"], request["options"]), record])
    return {"steps": record.steps}


def run_save(request: dict[str, Any]) -> dict[str, Any]:
    dirpath, options = request["dirpath"], request["options"]
    points = Points(request.get("kill"))
    # in place before the restore (whose S3 client the saver shares), counting after it
    TRACERS[request["backend"]](points, dirpath, options)
    unit, loader = fresh()
    if not restore(dirpath, options, unit, loader):
        raise AssertionError(f"the previous snapshot is missing from {dirpath}")
    record = Record(loader)
    points.armed = True
    train(unit, loader, max_steps=unit.train_progress.num_steps_completed + 1,
          callbacks=[saver(dirpath, options), record])
    points.armed = False
    return {"ops": points.ops, "steps": record.steps}


def run_check(request: dict[str, Any]) -> dict[str, Any]:
    """What a fresh process finds in dirpath and restores; then the next run, and its restore."""
    dirpath, options = request["dirpath"], request["options"]
    report: dict[str, Any] = {}
    store = open_store(dirpath, options)
    report["complete"] = complete = [s.text for s in listing.complete_snapshots(store)]
    report["damaged"] = {name: why for name in complete if (why := verify.check(store, name).problem) is not None}
    unit, loader = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report["restored"] = restore(dirpath, options, unit, loader)
    report["restore_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    report["fingerprint"] = fingerprint(unit, loader)

    step = unit.train_progress.num_steps_completed
    record = Record(loader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(unit, loader, max_steps=step + 1, callbacks=[saver(dirpath, options), record])
    report["next_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    report["next_steps"] = record.steps
    report["after_next"] = top_level(request["backend"], dirpath, options)
    again, again_loader = fresh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report["next_restored"] = restore(dirpath, options, again, again_loader)
    report["next_restore_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
    report["next_fingerprint"] = fingerprint(again, again_loader)
    return report


def top_level(backend: str, dirpath: str, options: Optional[dict[str, Any]]) -> list[str]:
    """Every name directly in dirpath (directories and files)."""
    if backend == "local":
        return sorted(os.listdir(dirpath))
    if backend == "s3":
        store = open_store(dirpath, options)
        assert isinstance(store, s3_store.S3Store)
        prefix = store.prefix + "/"
        names = set()
        pages = store.client.get_paginator("list_objects_v2").paginate(
            Bucket=store.bucket, Prefix=prefix, Delimiter="/"
        )
        for page in pages:
            names.update(c["Prefix"][len(prefix):].rstrip("/") for c in page.get("CommonPrefixes", []))
            names.update(o["Key"][len(prefix):] for o in page.get("Contents", []))
        return sorted(names)
    fs, root = fsspec.core.url_to_fs(dirpath, **(options or {}))
    fs.invalidate_cache()
    try:
        return sorted(str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root.rstrip("/"), detail=False))
    except FileNotFoundError:
        return []


# ------------------------------------------------------------------------------------------------
# The tracers: every storage operation of the run, in order; the kill at one of them.

_TOKENS = [
    (re.compile(r"[0-9a-f]{12}h[0-9a-f]{8}p[0-9]+n[0-9]+"), "<token>"),  # staging_token
    (re.compile(r"del[0-9a-f]{9}"), "del<id>"),  # a deletion's staging directory
]


def normalized(rel: str) -> str:
    for pattern, replacement in _TOKENS:
        rel = pattern.sub(replacement, rel)
    return rel


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # never reached: SIGKILL is delivered before kill() returns


class Points:
    """The operations seen, ``[kind, target, n, nbytes]`` each in the order they ran; the kill, if
    armed: ``{"key": [kind, target, n], "mid": bool}``."""

    def __init__(self, kill: Optional[dict[str, Any]]) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self.ops: list[list[Any]] = []
        self.kill = kill
        #: whether operations are counted now (and the kill can happen)
        self.armed = False

    def hit(self, kind: str, target: str, nbytes: int = 0, *, count: bool = True) -> bool:
        """An operation is about to run; kill this process here if it is the n-th of its kind on
        its target (n - 1 counted before it). True: the caller is to write half of its bytes,
        then call die(). ``count``: count it now (else :meth:`done` counts it once it has run
        without an error)."""
        with self._lock:
            if not self.armed:
                return False
            n = self._counts.get((kind, target), 0) + 1
            if count:
                self._count(kind, target, nbytes)
            if self.kill is None or self.kill["key"] != [kind, target, n]:
                return False
            if not self.kill.get("mid"):
                die()
            return True

    def done(self, kind: str, target: str, nbytes: int = 0) -> None:
        with self._lock:
            if self.armed:
                self._count(kind, target, nbytes)

    def _count(self, kind: str, target: str, nbytes: int) -> None:
        n = self._counts[(kind, target)] = self._counts.get((kind, target), 0) + 1
        self.ops.append([kind, target, n, nbytes])


def trace_local(points: Points, dirpath: str, options: Optional[dict[str, Any]]) -> None:
    """Wrap the os functions that change files, and builtins.open for writing, process-wide; the
    calls on dirpath and below are operations, counted once they have run without an error (an
    open that finds its directory missing, a mkdir that finds it made by another thread change
    nothing, and whether they happen depends on the threads' timing)."""
    root = os.path.realpath(dirpath)
    real = {name: getattr(os, name) for name in (
        "open", "write", "writev", "pwrite", "ftruncate", "fsync", "fdatasync", "mkdir", "rename",
        "replace", "unlink", "remove", "rmdir",
    )}
    real_open = builtins.open

    def where(path: Any, dir_fd: Optional[int] = None) -> Optional[str]:
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        path = os.path.abspath(path)
        if path == root:
            return "."
        if path.startswith(root + os.sep):
            return normalized(path[len(root) + 1:])
        return None

    def of_fd(fd: int) -> Optional[str]:
        try:
            return where(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return None

    def traced(kind: str, rel: Optional[str], run: Callable[[], Any], nbytes: int = 0,
               halfway: Optional[Callable[[], None]] = None) -> Any:
        if rel is None:
            return run()
        if points.hit(kind, rel, nbytes, count=False) and halfway is not None:
            halfway()
            die()
        result = run()
        points.done(kind, rel, nbytes)
        return result

    def bytes_of(data: Any) -> bytes:
        return memoryview(data).cast("B").tobytes()

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: Optional[int] = None) -> int:
        writing = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        rel = where(path, dir_fd) if writing else None
        return traced("open", rel, lambda: real["open"](path, flags, mode, dir_fd=dir_fd))  # type: ignore[no-any-return]

    def write(fd: int, data: Any) -> int:
        rel = of_fd(fd)
        if rel is None:
            return real["write"](fd, data)  # type: ignore[no-any-return]
        whole = bytes_of(data)
        return traced("write", rel, lambda: real["write"](fd, data), len(whole),
                      lambda: real["write"](fd, whole[: len(whole) // 2]))  # type: ignore[no-any-return]

    def writev(fd: int, buffers: Any) -> int:
        rel = of_fd(fd)
        buffers = list(buffers)
        if rel is None:
            return real["writev"](fd, buffers)  # type: ignore[no-any-return]
        whole = b"".join(bytes_of(b) for b in buffers)
        return traced("write", rel, lambda: real["writev"](fd, buffers), len(whole),
                      lambda: real["write"](fd, whole[: len(whole) // 2]))  # type: ignore[no-any-return]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        rel = of_fd(fd)
        if rel is None:
            return real["pwrite"](fd, data, offset)  # type: ignore[no-any-return]
        whole = bytes_of(data)
        return traced("write", rel, lambda: real["pwrite"](fd, data, offset), len(whole),
                      lambda: real["pwrite"](fd, whole[: len(whole) // 2], offset))  # type: ignore[no-any-return]

    def on_fd(kind: str) -> Callable[..., Any]:
        def wrapper(fd: int, *args: Any) -> Any:
            return traced(kind, of_fd(fd), lambda: real[kind](fd, *args))

        return wrapper

    def on_path(kind: str, name: str) -> Callable[..., Any]:
        def wrapper(path: Any, *args: Any, dir_fd: Optional[int] = None, **kwargs: Any) -> Any:
            return traced(kind, where(path, dir_fd), lambda: real[name](path, *args, dir_fd=dir_fd, **kwargs))

        return wrapper

    def rename(name: str) -> Callable[..., Any]:
        def wrapper(src: Any, dst: Any, *, src_dir_fd: Optional[int] = None, dst_dir_fd: Optional[int] = None) -> Any:
            a, b = where(src, src_dir_fd), where(dst, dst_dir_fd)
            return traced("rename", None if a is None and b is None else f"{a} -> {b}",
                          lambda: real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd))

        return wrapper

    def open_file(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        writing = isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+")
        return traced("open", where(file) if writing else None, lambda: real_open(file, mode, *args, **kwargs))

    os.open = open_
    os.write = write
    os.writev = writev
    os.pwrite = pwrite
    for kind in ("ftruncate", "fsync", "fdatasync"):
        setattr(os, kind, on_fd(kind))
    os.mkdir = on_path("mkdir", "mkdir")
    os.unlink = on_path("unlink", "unlink")
    os.remove = on_path("unlink", "remove")
    os.rmdir = on_path("rmdir", "rmdir")
    os.rename = rename("rename")
    os.replace = rename("replace")
    builtins.open = open_file


def trace_s3(points: Points, dirpath: str, options: Optional[dict[str, Any]]) -> None:
    """Every HTTP request of the S3 clients made from now on (botocore's before-send event)."""
    bucket, _, prefix = dirpath[len("s3://"):].partition("/")
    real_create_client = botocore.session.Session.create_client

    def rel(key: str) -> str:
        key = urllib.parse.unquote(key).rstrip("/")
        if key == prefix:
            return "."
        return normalized(key[len(prefix) + 1:] if key.startswith(prefix + "/") else "/" + key)

    def before_send(request: Any, **kwargs: Any) -> None:
        url = urllib.parse.urlsplit(request.url)
        path = urllib.parse.unquote(url.path).lstrip("/")
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        if "list-type" in query:
            kind, target = "LIST", rel(query.get("prefix", [""])[0])
            if query.get("delimiter"):
                target += " (one level)"
        elif "delete" in query:  # DeleteObjects: the keys are in the body
            body = request.body if isinstance(request.body, bytes) else b""
            kind = "DELETE-OBJECTS"
            target = ", ".join(sorted(rel(k) for k in re.findall(r"<Key>(.*?)</Key>", body.decode())))
        else:
            key = path[len(bucket) + 1:] if path.startswith(bucket + "/") else ""
            kind, target = request.method, rel(key) if key else "(bucket)"
        points.hit(kind, target)

    def create_client(self: Any, service_name: str, *args: Any, **kwargs: Any) -> Any:
        client = real_create_client(self, service_name, *args, **kwargs)
        if service_name == "s3":
            client.meta.events.register("before-send.s3", before_send)
        return client

    botocore.session.Session.create_client = create_client  # type: ignore[method-assign]


def trace_fsspec(points: Points, dirpath: str, options: Optional[dict[str, Any]]) -> None:
    """Every call on dirpath's fsspec filesystem object (the instance fsspec hands every store
    opened with these options) but its cache bookkeeping."""
    fs, root = fsspec.core.url_to_fs(dirpath, **(options or {}))
    root = root.rstrip("/")

    def rel(path: Any) -> str:
        if isinstance(path, (list, tuple)):
            return ", ".join(sorted(rel(p) for p in path))
        path = str(path).rstrip("/")
        if path == root:
            return "."
        return normalized(path[len(root) + 1:] if path.startswith(root + "/") else "/" + path)

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            points.hit(name, rel(args[0]) if args else "")
            return method(*args, **kwargs)

        return call

    for name in dir(fsspec.AbstractFileSystem):  # fsspec's API, not the implementation's helpers
        if (name.startswith("_") or name in ("invalidate_cache", "unstrip_protocol")
                or isinstance(inspect.getattr_static(fsspec.AbstractFileSystem, name), property)):
            continue
        method = getattr(fs, name)
        if callable(method):
            setattr(fs, name, counted(name, method))


TRACERS: dict[str, Callable[[Points, str, Optional[dict[str, Any]]], None]] = {"local": trace_local, "s3": trace_s3, "fsspec": trace_fsspec}
RUNS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "reference": run_reference, "setup": run_setup, "save": run_save, "check": run_check,
}


# ------------------------------------------------------------------------------------------------
# The server.


def child(request: dict[str, Any], out: int) -> None:
    code = 0
    try:
        reply = {"result": RUNS[request["op"]](request)}
    except BaseException:
        reply = {"error": traceback.format_exc()}
        code = 1
    try:
        data = json.dumps(reply).encode()
        while data:
            data = data[_write(out, data):]
    finally:
        os._exit(code)


def reap(pid: int, read: int, timeout_s: float) -> dict[str, Any]:
    """The child's reply and how it ended; killed (and said so) if it runs past ``timeout_s``."""
    chunks = []
    deadline = time.monotonic() + timeout_s
    timed_out = False
    while True:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
            break
        chunk = os.read(read, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    reply = json.loads(b"".join(chunks) or b"{}") if not timed_out else {}
    if timed_out:
        reply["error"] = f"the child ran for more than {timeout_s:.0f}s and was killed"
    reply.setdefault("result", None)
    reply.setdefault("error", None)
    reply["signal"] = None if timed_out or not os.WIFSIGNALED(status) else os.WTERMSIG(status)
    reply["exit_code"] = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    return reply


def main() -> None:
    assert threading.active_count() == 1, "the fork server must not start threads"
    torch.set_num_threads(1)
    _write(1, b'{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            child(request, write)
        os.close(write)
        reply = reap(pid, read, float(request.get("timeout_s", 120)))
        data = (json.dumps(reply) + "\n").encode()
        while data:
            data = data[_write(1, data):]


if __name__ == "__main__":
    main()
