"""The subprocess of tests/test_no_patches.py: one fresh interpreter per run.

    python no_patches_worker.py plugin OUT_JSON DIR   # trains with the plugin's saver, restores
    python no_patches_worker.py baseline OUT_JSON     # the same training draws, no plugin

Records, before the plugin is imported: the attributes of every torchsnapshot module (all of them
imported first) and of the classes they define, ``os.environ``, the gc settings, the signal
handlers, torch's safe-globals list and torchsnapshot's loggers. Then trains a real torchtnt
loop (synchronous and asynchronous snapshots) and restores, and writes to OUT_JSON what changed,
the environment variables seen changed while the plugin serialized an object entry (during a
write), and digests of the global RNG states.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import importlib
import json
import logging
import os
import pkgutil
import random
import signal
import sys
import types
from typing import Any

import numpy as np
import torch
import torchsnapshot
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

_ENV_BEFORE: dict[str, str] = {}
#: what a Probe saw each time it was pickled (during a write): changed env vars, gc enabled
PROBES: list[dict[str, Any]] = []


class Probe:
    """An object entry: pickling it (as a snapshot write does) records the process state then."""

    def __reduce__(self) -> Any:
        env = dict(os.environ)
        changed = sorted(
            k for k in env.keys() | _ENV_BEFORE.keys() if env.get(k) != _ENV_BEFORE.get(k)
        )
        PROBES.append({"env_changed": {k: env.get(k) for k in changed}, "gc_enabled": gc.isenabled()})
        return (Probe, ())


class Slot:
    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class DrawingUnit(TrainUnit[Any]):
    """Each step draws from torch (dropout), Python's random and numpy."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.extra = Slot({"probe": Probe(), "n": 1, "t": torch.arange(600.0)})

    def train_step(self, state: State, data: Any) -> None:
        x, y = data
        scale = 1.0 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.mse_loss(self.model(x), y) * scale
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def _import_all_torchsnapshot() -> None:
    for info in pkgutil.walk_packages(torchsnapshot.__path__, "torchsnapshot."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # optional backends (gcs, deepspeed) not installed
            pass


_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
                staticmethod, classmethod, property)


def _freeze(value: Any) -> tuple[str, Any]:
    if isinstance(value, _BY_IDENTITY) or callable(value) or type(value).__eq__ is object.__eq__:
        return ("is", value)
    try:
        return ("==", copy.deepcopy(value))
    except Exception:
        return ("is", value)


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] == "is":
        return a[1] is b[1]
    try:
        return bool(a[1] == b[1])
    except Exception:
        return a[1] is b[1]


def module_attributes() -> dict[str, tuple[str, Any]]:
    """torchsnapshot's module attributes and the attributes of the classes it defines."""
    found: dict[str, tuple[str, Any]] = {}
    for name, module in sorted(sys.modules.items()):
        if name != "torchsnapshot" and not name.startswith("torchsnapshot."):
            continue
        for attr, value in list(vars(module).items()):
            if attr == "__builtins__":
                continue
            found[f"{name}.{attr}"] = _freeze(value)
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    found[f"{name}.{attr}.{cattr}"] = _freeze(cvalue)
    return found


def _name(obj: Any) -> str:
    if isinstance(obj, tuple):  # (global, "module.name") as torch allows
        return repr(obj)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def process_state() -> dict[str, tuple[str, Any]]:
    state: dict[str, tuple[str, Any]] = {
        "gc.isenabled()": ("==", gc.isenabled()),
        "gc.get_threshold()": ("==", gc.get_threshold()),
        "gc.get_freeze_count()": ("==", gc.get_freeze_count()),
        "torch.serialization.get_safe_globals()": ("==", sorted(_name(g) for g in torch.serialization.get_safe_globals())),
    }
    for key, value in os.environ.items():
        state[f"os.environ[{key!r}]"] = ("==", value)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        state[f"signal handler {sig.name}"] = ("is", signal.getsignal(sig))
    for name, logger in sorted(logging.root.manager.loggerDict.items()):
        if name.startswith("torchsnapshot") and isinstance(logger, logging.Logger):
            state[f"logger {name}"] = ("==", (logger.level, logger.disabled, logger.propagate, list(logger.handlers)))
    return state


def compare(before: dict[str, tuple[str, Any]], after: dict[str, tuple[str, Any]]) -> list[str]:
    out = []
    for key in sorted(before.keys() | after.keys()):
        if key not in after:
            out.append(f"{key}: removed")
        elif key not in before:
            out.append(f"{key}: added ({after[key][1]!r:.100})")
        elif not _same(before[key], after[key]) and isinstance(before[key][1], list):
            old, new = before[key][1], after[key][1]
            out.append(f"{key}: added {[x for x in new if x not in old]}, removed {[x for x in old if x not in new]}")
        elif not _same(before[key], after[key]):
            out.append(f"{key}: {before[key][1]!r:.100} -> {after[key][1]!r:.100}")
    return out


def rng_digests() -> dict[str, str]:
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:16]

    np_state = np.random.get_state()
    return {
        "python random": digest(repr(random.getstate()).encode()),
        "numpy": digest(np_state[1].tobytes() + repr(np_state[2:]).encode()),
        "torch CPU": digest(torch.get_rng_state().numpy().tobytes()),
    }


def main(mode: str, out_json: str, dirpath: str = "") -> None:
    _import_all_torchsnapshot()
    _ENV_BEFORE.update(os.environ)
    attributes_before = module_attributes()
    process_before = process_state()
    # the same draws in both modes: seeds, two units' initial weights, the data
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    unit, fresh, fresh_async = DrawingUnit(), DrawingUnit(), DrawingUnit()
    data = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(4)]
    report: dict[str, Any] = {}

    if mode == "plugin":
        from torchtnt.framework.callbacks.checkpointer_types import KnobOptions

        from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

        sync_dir, async_dir = os.path.join(dirpath, "sync"), os.path.join(dirpath, "async")
        sync_saver = TorchSnapshotSaver(sync_dir, save_every_n_train_steps=2, async_snapshot=False,
                                        weights_only=False, knob_options=KnobOptions(max_per_rank_io_concurrency=2))
        train(unit, data, max_epochs=2, callbacks=[sync_saver])
        after_sync = {k: v.clone() for k, v in unit.model.state_dict().items()}
        async_saver = TorchSnapshotSaver(async_dir, save_every_n_train_steps=3, async_snapshot=True, weights_only=False)
        train(unit, data, max_epochs=4, callbacks=[async_saver])
        report["rng after train"] = rng_digests()
        assert TorchSnapshotSaver.restore_from_latest(sync_dir, fresh, weights_only=False)
        latest_async = sorted(os.listdir(async_dir), key=lambda n: int(n.split("_")[3]))[-1]
        TorchSnapshotSaver.restore(os.path.join(async_dir, latest_async), fresh_async, weights_only=False)
        for saved, restored in ((after_sync, fresh), (unit.model.state_dict(), fresh_async)):
            for key, value in saved.items():
                assert torch.equal(value, restored.model.state_dict()[key]), f"restore did not load {key}"
        report["rng after restore"] = rng_digests()
        report["snapshots"] = sorted(os.listdir(sync_dir)) + sorted(os.listdir(async_dir))
    else:
        train(unit, data, max_epochs=2)
        train(unit, data, max_epochs=4)
        report["rng after train"] = rng_digests()

    report["differences"] = compare(attributes_before, module_attributes()) + compare(
        process_before, process_state()
    )
    report["probes"] = PROBES
    report["plugin imported"] = any(m.startswith("tnt_snapshot_plugin") for m in sys.modules)
    with open(out_json, "w") as f:
        json.dump(report, f, default=str)


if __name__ == "__main__":
    main(*sys.argv[1:])
