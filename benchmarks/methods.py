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
  power cut. DCP and this plugin fsync on their own.

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

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.name = f"tnt_snapshot_plugin {'async' if asynchronous else 'sync'}"

    def _make_saver(self, root: str) -> Any:
        from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

        return TorchSnapshotSaver(
            root,
            save_every_n_train_steps=1,
            async_snapshot=self.asynchronous,
            save_on_train_end=False,
            preemption_signals=[],
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


class DCP(Method):
    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self.name = "torch.distributed.checkpoint " + ("async_save" if asynchronous else "save")

    def save(self, step: int) -> tuple[float, float, str]:
        import torch.distributed.checkpoint as dcp

        path = os.path.join(self.root, f"step_{step}")
        state = {"model": self.model.state_dict()}
        t = time.perf_counter()
        if self.asynchronous:
            future = dcp.async_save(state, checkpoint_id=path)
            stall = time.perf_counter() - t
            future.result()
        else:
            dcp.save(state, checkpoint_id=path)
            stall = time.perf_counter() - t
        return stall, time.perf_counter() - t, path  # FileSystemWriter fsyncs (sync_files=True)

    def restore(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        state = {"model": self.target.state_dict()}  # loaded in place into target's tensors
        dcp.load(state, checkpoint_id=path)


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
        TorchtntSaver(asynchronous=True),
        TorchtntSaver(asynchronous=False),
        TorchsnapshotPlain(asynchronous=True),
        TorchsnapshotPlain(asynchronous=False),
        TorchSave(),
        DCP(asynchronous=True),
        DCP(asynchronous=False),
        Lightning(asynchronous=True),
        Lightning(asynchronous=False),
    ]


def select(names: Optional[list[str]]) -> list[Method]:
    methods = all_methods()
    if not names:
        return methods
    chosen = [m for m in methods if any(n.lower() in m.name.lower() for n in names)]
    if not chosen:
        raise SystemExit(f"no method matches {names}; methods: {[m.name for m in methods]}")
    return chosen
