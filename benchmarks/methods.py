"""The checkpointers compared, each behind the same small interface.

Every method saves the same ``torch.nn.Module`` (``model``, parameters only) and restores into a
second module of the same shapes whose tensors are already allocated (``target``). The torchtnt
savers get the module inside a real torchtnt ``TrainUnit`` (so they also save the progress and
RNG state they always add); Lightning gets it inside a ``LightningModule`` attached to a real
``Trainer``.

``save(step)`` returns ``(stall_s, durable_s, path)``:

* ``stall_s``: how long the call that a training loop makes blocks it;
* ``durable_s``: from the start of that call until every byte is on disk. For writers that do
  not fsync (torch.save, torchsnapshot, Lightning) the benchmark fsyncs the files they wrote
  right after they finish and counts that time: without it the snapshot could be lost by a
  power cut. This plugin fsyncs its files and directories on its own. DCP's ``FileSystemWriter``
  fsyncs each file it writes (``sync_files=True``, its default) but not the directory that the
  ``.metadata`` rename changes, and torchtnt's ``DistributedCheckpointSaver`` writes with
  ``sync_files=False``: every DCP row gets ``fsync_tree`` after its save finishes, as the other
  stock writers do (on files DCP already fsynced it costs one ``fsync`` of clean pages each).

``restore(path)`` loads the snapshot into ``target`` (timed by the caller, page cache evicted).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Optional

import torch
from measure import fsync_tree


class Method:
    name = ""
    #: False for this plugin's own rows; True for the peers it is compared with.
    peer = True
    asynchronous = False
    #: "dcp" for the stock rows that write DCP's format (the peers of the plugin's DCP row).
    family = ""
    #: The on-disk format the plugin's rows write.
    format = ""

    def setup(self, root: str, model: torch.nn.Module, target: torch.nn.Module) -> None:
        self.root = root
        self.model = model
        self.target = target

    def save(self, step: int) -> tuple[float, float, str]:
        raise NotImplementedError

    def restore(self, path: str) -> None:
        raise NotImplementedError

    def discard(self, path: str) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def close(self) -> None:
        pass


def _timed_call(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t, out


# ------------------------------------------------------------------------------------------------
# torchtnt scaffolding shared by this plugin and torchtnt's own saver


def _tnt_unit(module: torch.nn.Module) -> Any:
    from torchtnt.framework.unit import TrainUnit

    class BenchUnit(TrainUnit[Any]):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def train_step(self, state: Any, data: Any) -> None:  # pragma: no cover - never run
            pass

    return BenchUnit(module)


def _tnt_state() -> Any:
    from torchtnt.framework.state import EntryPoint, PhaseState, State

    return State(entry_point=EntryPoint.TRAIN, train_state=PhaseState(dataloader=[]))


class _TntMethod(Method):
    def setup(self, root: str, model: torch.nn.Module, target: torch.nn.Module) -> None:
        super().setup(root, model, target)
        self.unit = _tnt_unit(model)
        self.target_unit = _tnt_unit(target)
        self.state = _tnt_state()
        self.saver = self._make_saver(root)
        self.saver.on_train_start(self.state, self.unit)

    def _make_saver(self, root: str) -> Any:
        raise NotImplementedError

    def _newest(self) -> str:
        names = [n for n in os.listdir(self.root) if n.startswith("epoch_")]
        names.sort(key=lambda n: int(n.rsplit("_", 1)[1]))
        return os.path.join(self.root, names[-1])


class PluginSaver(_TntMethod):
    """This plugin through its torchtnt adapter (a real Callback driven by hand)."""

    peer = False

    def __init__(self, asynchronous: bool, format: str = "torchsnapshot") -> None:
        self.asynchronous = asynchronous
        self.format = format
        fmt = "" if format == "torchsnapshot" else f" ({format})"
        self.name = f"tnt_snapshot_plugin{fmt} {'async' if asynchronous else 'sync'}"

    def _make_saver(self, root: str) -> Any:
        from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

        return TorchSnapshotSaver(
            root,
            save_every_n_train_steps=1,
            async_snapshot=self.asynchronous,
            save_on_train_end=False,
            preemption_signals=[],
            format=self.format,
        )

    def save(self, step: int) -> tuple[float, float, str]:
        self.unit.train_progress.increment_step()
        t = time.perf_counter()
        self.saver.on_train_step_end(self.state, self.unit)
        stall = time.perf_counter() - t
        self.saver.snapshotter.wait()
        durable = time.perf_counter() - t
        return stall, durable, self.saver.snapshotter.stats.committed[-1].path

    def restore(self, path: str) -> None:
        from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

        TorchSnapshotSaver.restore(path, self.target_unit)

    def close(self) -> None:
        self.saver.snapshotter.wait()


class TorchtntSaver(_TntMethod):
    """torchtnt 0.2.4's own TorchSnapshotSaver (torchsnapshot-nightly underneath)."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.name = f"torchtnt TorchSnapshotSaver {'async' if asynchronous else 'sync'}"

    def _make_saver(self, root: str) -> Any:
        from torchtnt.framework.callbacks import TorchSnapshotSaver

        return TorchSnapshotSaver(
            root, save_every_n_train_steps=1, async_checkpoint=self.asynchronous
        )

    def save(self, step: int) -> tuple[float, float, str]:
        self.unit.train_progress.increment_step()
        t = time.perf_counter()
        self.saver.on_train_step_end(self.state, self.unit)
        stall = time.perf_counter() - t
        pending = self.saver._prev_snapshot  # torchtnt keeps the PendingSnapshot here
        if pending is not None:
            pending.wait()
        path = self._newest()
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        from torchtnt.framework.callbacks import TorchSnapshotSaver

        TorchSnapshotSaver.restore(path, self.target_unit)


# ------------------------------------------------------------------------------------------------
# plain libraries


class TorchsnapshotPlain(Method):
    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.name = "torchsnapshot " + ("Snapshot.async_take" if asynchronous else "Snapshot.take")

    def save(self, step: int) -> tuple[float, float, str]:
        from torchsnapshot import Snapshot

        path = os.path.join(self.root, f"step_{step}")
        app_state = {"model": self.model}
        t = time.perf_counter()
        if self.asynchronous:
            pending = Snapshot.async_take(path, app_state=app_state)
            stall = time.perf_counter() - t
            pending.wait()
        else:
            Snapshot.take(path, app_state=app_state)
            stall = time.perf_counter() - t
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        from torchsnapshot import Snapshot

        Snapshot(path).restore({"model": self.target})


class TorchSave(Method):
    name = "torch.save / torch.load(mmap=True)"

    def save(self, step: int) -> tuple[float, float, str]:
        path = os.path.join(self.root, f"step_{step}.pt")
        t = time.perf_counter()
        torch.save(self.model.state_dict(), path)
        stall = time.perf_counter() - t
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        state = torch.load(path, mmap=True, weights_only=True)
        self.target.load_state_dict(state)


#: The stock DCP modes (``DCP(mode=...)``) and the row each one is.
DCP_MODES = {
    "save": "torch.distributed.checkpoint save",
    "thread": "torch.distributed.checkpoint async_save",
    "process": "torch.distributed.checkpoint async_save (PROCESS)",
    "stager": "torch.distributed.checkpoint async_save + DefaultStager",
}


class DCP(Method):
    """Stock ``torch.distributed.checkpoint`` with its default ``FileSystemWriter``; restore with
    ``dcp.load`` in place into ``target``'s tensors.

    ``mode``:

    * ``save``: ``dcp.save``;
    * ``thread``: ``dcp.async_save`` with its default thread executor (the state copied to CPU
      memory, synchronously, before it returns);
    * ``process``: ``async_checkpointer_type=AsyncCheckpointerType.PROCESS``: the copy, then the
      write in a daemon process DCP spawns at the first save and keeps (its start, several
      seconds of importing torch and joining a gloo group, falls in the warm-up snapshot); the
      tensors reach it through shared memory, with torch's ``file_system`` sharing strategy
      (with the default ``file_descriptor``, 10,000 tensors fail: "Too many open files");
    * ``stager``: ``async_stager=DefaultStager(...)``, one stager kept across saves (it reuses
      its staging buffers), staging in its background thread. ``DefaultStager()`` with its
      default ``StagingOptions`` raises on a machine without an accelerator (``AssertionError:
      Non-blocking copy requires that the current accelerator is available.``; pinned memory
      also needs CUDA): the row runs with ``use_pinned_memory=False, use_shared_memory=False,
      use_async_staging=True, use_non_blocking_copy=False``, what runs on CPU. The training
      loop may change the weights only once staging is done (``staging_completion``): the
      stall is until then.
    """

    family = "dcp"

    def __init__(self, mode: str) -> None:
        if mode not in DCP_MODES:
            raise ValueError(f"mode must be one of {sorted(DCP_MODES)}, got {mode!r}")
        self.mode = mode
        self.asynchronous = mode != "save"
        self.name = DCP_MODES[mode]
        self.stager: Any = None

    def setup(self, root: str, model: torch.nn.Module, target: torch.nn.Module) -> None:
        super().setup(root, model, target)
        if self.mode == "stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False, use_shared_memory=False,
                    use_async_staging=True, use_non_blocking_copy=False,
                )
            )
        if self.mode == "process":
            import torch.multiprocessing as mp

            # The daemon's gloo group meets at MASTER_ADDR, else at the host's fully qualified
            # name, which need not resolve to an address of this host.
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            # The staged tensors go to the daemon through shared memory, by default one open file
            # descriptor per tensor: at 10,000 tensors that meets a limit of 20,000 open files
            # ("Too many open files"). torch's remedy is the file_system sharing strategy.
            self._sharing = mp.get_sharing_strategy()
            mp.set_sharing_strategy("file_system")

    def save(self, step: int) -> tuple[float, float, str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        path = os.path.join(self.root, f"step_{step}")
        t = time.perf_counter()
        state = {"model": self.model.state_dict()}  # every other row's call makes it inside the timing
        if self.mode == "save":
            dcp.save(state, checkpoint_id=path)
            stall = time.perf_counter() - t
        elif self.mode == "stager":
            response = dcp.async_save(state, checkpoint_id=path, async_stager=self.stager)
            response.staging_completion.result()  # the weights may change from here on
            stall = time.perf_counter() - t
            response.upload_completion.result()
        else:
            kind = AsyncCheckpointerType.PROCESS if self.mode == "process" else AsyncCheckpointerType.THREAD
            future = dcp.async_save(state, checkpoint_id=path, async_checkpointer_type=kind)
            stall = time.perf_counter() - t
            future.result()
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = {"model": self.target.state_dict()}  # loaded in place into target's tensors
        dcp.load(state, checkpoint_id=path)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.mode == "process":
            import torch.multiprocessing as mp

            mp.set_sharing_strategy(self._sharing)


class TorchtntDCPSaver(_TntMethod):
    """torchtnt 0.2.4's own ``DistributedCheckpointSaver`` (``async_checkpoint=True``): stock
    ``dcp.async_save`` with its thread executor, a ``FileSystemWriter`` of 16 threads, one file
    per tensor and ``sync_files=False``; restore with ``DistributedCheckpointSaver.restore``
    (``dcp.load``)."""

    family = "dcp"
    asynchronous = True
    name = "torchtnt DistributedCheckpointSaver async"

    def _make_saver(self, root: str) -> Any:
        from torchtnt.framework.callbacks import DistributedCheckpointSaver

        return DistributedCheckpointSaver(root, save_every_n_train_steps=1, async_checkpoint=True)

    def save(self, step: int) -> tuple[float, float, str]:
        self.unit.train_progress.increment_step()
        t = time.perf_counter()
        self.saver.on_train_step_end(self.state, self.unit)
        stall = time.perf_counter() - t
        self.saver._wait()  # torchtnt keeps the pending save's future in _prev_snapshot
        path = self._newest()
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        from torchtnt.framework.callbacks import DistributedCheckpointSaver

        DistributedCheckpointSaver.restore(path, self.target_unit)


class Lightning(Method):
    """``Trainer.save_checkpoint``: what ``ModelCheckpoint`` calls to write (and
    ``AsyncCheckpointIO``, Lightning's background-thread writer, when asynchronous)."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.name = (
            "Lightning save_checkpoint + AsyncCheckpointIO"
            if asynchronous
            else "Lightning ModelCheckpoint (save_checkpoint)"
        )

    def setup(self, root: str, model: torch.nn.Module, target: torch.nn.Module) -> None:
        super().setup(root, model, target)
        import logging

        import pytorch_lightning as pl

        for name in ("pytorch_lightning", "lightning_fabric", "lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)

        class Lit(pl.LightningModule):
            def __init__(self, inner: torch.nn.Module) -> None:
                super().__init__()
                self.inner = inner

        plugins = []
        if self.asynchronous:
            from pytorch_lightning.plugins.io import AsyncCheckpointIO

            plugins.append(AsyncCheckpointIO())
        self.trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            plugins=plugins,
        )
        self.lit = Lit(model)
        self.target_lit = Lit(target)
        self.trainer.strategy.connect(self.lit)

    def save(self, step: int) -> tuple[float, float, str]:
        path = os.path.join(self.root, f"step_{step}.ckpt")
        t = time.perf_counter()
        self.trainer.save_checkpoint(path)
        stall = time.perf_counter() - t
        if self.asynchronous:
            self.trainer.strategy.checkpoint_io.teardown()  # waits for the writer thread
        fsync_tree(path)
        return stall, time.perf_counter() - t, path

    def restore(self, path: str) -> None:
        checkpoint = self.trainer.strategy.load_checkpoint(path)
        self.target_lit.load_state_dict(checkpoint["state_dict"])


def all_methods() -> list[Method]:
    return [
        PluginSaver(asynchronous=True),
        PluginSaver(asynchronous=False),
        PluginSaver(asynchronous=True, format="dcp"),
        TorchtntSaver(asynchronous=True),
        TorchtntSaver(asynchronous=False),
        TorchsnapshotPlain(asynchronous=True),
        TorchsnapshotPlain(asynchronous=False),
        TorchSave(),
        DCP("thread"),
        DCP("process"),
        DCP("stager"),
        DCP("save"),
        TorchtntDCPSaver(),
        Lightning(asynchronous=True),
        Lightning(asynchronous=False),
    ]


def select(names: Optional[list[str]]) -> list[Method]:
    methods = all_methods()
    if not names:
        return methods
    # "dcp" also names every row that writes DCP's format (the plugin's, the stock ones)
    chosen = [
        m for m in methods
        if any(n.lower() in m.name.lower() or n.lower() in (m.family, m.format) for n in names)
    ]
    if not chosen:
        raise SystemExit(f"no method matches {names}; methods: {[m.name for m in methods]}")
    return chosen
