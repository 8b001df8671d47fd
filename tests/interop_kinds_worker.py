"""The state of tests/test_interop_kinds.py, and its subprocess side, which never imports the plugin.

Importable (the unit, the values of every entry kind, a bitwise comparison) and runnable:

    python interop_kinds_worker.py check-plugin-written OUT_JSON REF SNAPSHOT...
        restores each snapshot the plugin wrote with stock torchsnapshot (``Snapshot.restore``
        into fresh objects, ``read_object`` for single entries) and with torchtnt 0.2.4's own
        ``TorchSnapshotSaver.restore``, and writes what differs from the reference to OUT_JSON;
    python interop_kinds_worker.py check-two-ranks OUT_JSON DIR
        the same for a snapshot two ranks wrote (replicated entries and per-rank ones): restored as
        rank 0 by ``Snapshot.restore``, each rank's view read with ``read_object``;
    python interop_kinds_worker.py write-two-ranks RANK INIT_FILE DIR
        one of two gloo ranks writing that snapshot with the plugin's saver (imports the plugin);
    python interop_kinds_worker.py write-stock OUT_DIR
        writes a snapshot with stock ``Snapshot.take`` (its large tensor as a ChunkedTensor) and
        one with torchtnt's own saver during a real ``train``, and the values they hold.
"""

from __future__ import annotations

import collections
import copy
import json
import os
import struct
import sys
import traceback
from typing import Any

import numpy as np
import torch
from torchtnt.framework.state import State
from torchtnt.framework.unit import TrainUnit

KINDS_KEYS = ("dense", "packed", "large", "prims", "objs")


class Slot:
    """A Stateful holding one state dict as it is (the unit tracks it as a misc stateful)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def kinds(stock_writable: bool = False) -> dict[str, Any]:
    """One value of every entry kind, keyed by the unit attribute that holds it.

    ``stock_writable``: only what stock torchsnapshot's ``take`` can write (it raises on a
    bfloat16 tensor of an odd length and on an empty tensor of two or more dimensions).
    """
    g = torch.Generator().manual_seed(1234)
    f32 = torch.randn(37, generator=g)
    f32[3], f32[4], f32[5] = float("nan"), -0.0, float("inf")
    dense: dict[str, Any] = {
        "f32": f32,
        "f64": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "bf16": torch.randn(8 if stock_writable else 7, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (6,), generator=g, dtype=torch.int64),
        "bool": torch.randint(0, 2, (9,), generator=g).bool(),
        "u8": torch.randint(0, 256, (11,), generator=g).to(torch.uint8),
        "zero_d": torch.tensor(2.5),
        # the saved copy of a non-contiguous tensor (a transposed view)
        "noncontig": torch.arange(24, dtype=torch.float32).reshape(4, 6).t(),
    }
    if not stock_writable:
        dense["empty_2d"] = torch.empty(0, 3)
    packed = {f"t{i:03d}": torch.randn(i % 7 + 1, generator=g) for i in range(300)}
    large = {"big": torch.randn(1_400_000, generator=g)}  # 5.6 MB: a file of its own
    prims = {
        "int": -(2**40) + 3,
        "float": -0.0,
        "float_frac": 0.1,
        "str": "snap/shot \u00fc",
        "bool": False,
        "bytes": b"\x00\xff/ab",
    }
    objs = {
        "tuple": (1, "a", 2.5),
        "set": {3, 1, 2},
        "ndarray": np.arange(10, dtype=np.int32).reshape(2, 5),
        "nested": {1: {2: torch.arange(3)}, 10: "ten", "k/slash": 4},
        "ordered": collections.OrderedDict([("b", 1), ("a", torch.ones(2))]),
        "mixed": [1, "two", 3.0, None, torch.tensor([4, 5]), [6, {"seven": 7}]],
        "none": None,
    }
    return {"dense": dense, "packed": packed, "large": large, "prims": prims, "objs": objs}


def blank(value: Any) -> Any:
    """A fresh target for ``value``: tensors zeroed with the same shape, dtype and layout
    (a transposed one stays transposed), containers kept, everything else left out."""
    if isinstance(value, torch.Tensor):
        if not value.is_contiguous() and value.dim() == 2:
            return torch.zeros(value.shape[1], value.shape[0], dtype=value.dtype).t()
        return torch.zeros_like(value)
    if type(value) in (dict, collections.OrderedDict):
        kept = {k: blank(v) for k, v in value.items() if isinstance(v, (torch.Tensor, dict))}
        return type(value)(kept)
    return None


class KindsUnit(TrainUnit[Any]):
    """A unit whose state holds a small model, an Adam optimizer with state, an LR scheduler,
    and one Slot per group of entry kinds (:func:`kinds`); ``fresh=True``: untrained, other
    weights, and Slots holding blank targets."""

    def __init__(self, seed: int = 0, *, fresh: bool = False, stock_writable: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        values = kinds(stock_writable)
        for key in KINDS_KEYS:
            state = values[key]
            if fresh:
                state = {k: b for k, v in state.items() if (b := blank(v)) is not None}
            setattr(self, key, Slot(state))

    def train_step(self, state: State, data: Any) -> None:
        x, y = data
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def on_train_epoch_end(self, state: State) -> None:
        self.lr_scheduler.step()


def batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)) for _ in range(n)]


def unit_state(unit: Any) -> dict[str, Any]:
    """Every entry of the unit's app state, as its state dict now (a deep copy)."""
    return {key: copy.deepcopy(stateful.state_dict()) for key, stateful in unit.app_state().items()}


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """What differs between two values, bit for bit: types, dtypes, shapes, bytes, keys and order."""
    out: list[str] = []
    _diff(expected, actual, path, out)
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _diff(exp: Any, act: Any, path: str, out: list[str]) -> None:
    if type(exp) is not type(act):
        out.append(f"{path}: {type(exp).__name__} saved, {type(act).__name__} restored ({act!r:.80})")
        return
    if isinstance(exp, torch.Tensor):
        if exp.dtype != act.dtype or exp.shape != act.shape:
            out.append(f"{path}: {exp.dtype}{list(exp.shape)} saved, {act.dtype}{list(act.shape)} restored")
        elif _bytes(exp) != _bytes(act):
            out.append(f"{path}: the {exp.dtype}{list(exp.shape)} tensor's bytes differ")
    elif isinstance(exp, np.ndarray):
        if exp.dtype != act.dtype or exp.shape != act.shape or exp.tobytes() != act.tobytes():
            out.append(f"{path}: ndarray {exp.dtype}{exp.shape} saved, {act.dtype}{act.shape} restored, or bytes differ")
    elif isinstance(exp, dict):
        if list(exp.keys()) != list(act.keys()):
            out.append(f"{path}: keys {list(exp.keys())!r:.200} saved, {list(act.keys())!r:.200} restored")
        for key in [k for k in exp.keys() if k in act]:
            _diff(exp[key], act[key], f"{path}/{key}", out)
    elif isinstance(exp, (list, tuple)):
        if len(exp) != len(act):
            out.append(f"{path}: {len(exp)} items saved, {len(act)} restored")
        for i, (e, a) in enumerate(zip(exp, act, strict=False)):
            _diff(e, a, f"{path}/{i}", out)
    elif isinstance(exp, float):
        if struct.pack("<d", exp) != struct.pack("<d", act):
            out.append(f"{path}: float {exp!r} saved, {act!r} restored")
    elif exp != act:
        out.append(f"{path}: {exp!r:.80} saved, {act!r:.80} restored")


def allow_numpy() -> None:
    """What a stock torchsnapshot user adds to torch's allow-list to load numpy arrays
    (torch.load runs with weights_only=True by default)."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    torch.serialization.add_safe_globals(
        [core.multiarray._reconstruct, np.ndarray, np.dtype, *(
            c for n in dir(np.dtypes) if isinstance(c := getattr(np.dtypes, n), type)
        )]
    )


# ------------------------------------------------------------------------------------------------
# subprocess side


def _attempt(report: dict[str, list[str]], name: str, fn: Any, *args: Any) -> None:
    try:
        report[name] = fn(*args)
    except Exception as exc:  # recorded: the parent's assertion names it
        report[name] = [f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"]


# single entries read with read_object: (manifest path, path into the reference)
SINGLE_ENTRIES = [
    ("0/dense/f32", ("dense", "f32")),
    ("0/dense/bf16", ("dense", "bf16")),
    ("0/dense/empty_2d", ("dense", "empty_2d")),
    ("0/dense/noncontig", ("dense", "noncontig")),
    ("0/packed/t123", ("packed", "t123")),
    ("0/large/big", ("large", "big")),
    ("0/prims/int", ("prims", "int")),
    ("0/prims/float", ("prims", "float")),
    ("0/prims/str", ("prims", "str")),
    ("0/prims/bool", ("prims", "bool")),
    ("0/prims/bytes", ("prims", "bytes")),
    ("0/objs/tuple", ("objs", "tuple")),
    ("0/objs/set", ("objs", "set")),
    ("0/objs/ndarray", ("objs", "ndarray")),
    ("0/objs/nested/1/2", ("objs", "nested", 1, 2)),
    ("0/objs/nested/k%2Fslash", ("objs", "nested", "k/slash")),
    ("0/objs/mixed/4", ("objs", "mixed", 4)),
    ("0/optimizer/state/0/exp_avg", ("optimizer", "state", 0, "exp_avg")),
    ("0/optimizer/param_groups/0/betas", ("optimizer", "param_groups", 0, "betas")),
]


def _stock_restore(snap: str, expected: Any) -> list[str]:
    import torchsnapshot

    fresh = KindsUnit(seed=5, fresh=True)
    torchsnapshot.Snapshot(snap).restore(dict(fresh.app_state()))
    return differences(expected, unit_state(fresh))


def _stock_read_object(snap: str, expected: Any, expected_rng: torch.Tensor) -> list[str]:
    import torchsnapshot

    snapshot = torchsnapshot.Snapshot(snap)
    found: list[str] = []
    for path, where in SINGLE_ENTRIES:
        value = expected
        for part in where:
            value = value[part]
        try:
            found += differences(value, snapshot.read_object(path), path)
        except Exception as exc:
            found.append(f"{path}: read_object raised {type(exc).__name__}: {str(exc)[:300]}")
    found += differences(expected_rng, snapshot.read_object("0/rng_state/rng_state"), "0/rng_state/rng_state")
    return found


def _torchtnt_restore(snap: str, expected: Any, expected_rng: torch.Tensor) -> list[str]:
    from torchtnt.framework.callbacks import TorchSnapshotSaver as TorchtntSaver

    fresh = KindsUnit(seed=6, fresh=True)
    torch.manual_seed(99)
    TorchtntSaver.restore(snap, fresh)
    return differences(expected, unit_state(fresh)) + differences(
        expected_rng, torch.get_rng_state(), "torch RNG after restore"
    )


def check_plugin_written(out_json: str, ref_path: str, snapshots: list[str]) -> None:
    allow_numpy()
    ref = torch.load(ref_path, weights_only=False)
    expected, expected_rng = ref["state"], ref["torch_rng"]
    report: dict[str, list[str]] = {}
    for snap in snapshots:
        name = os.path.basename(os.path.dirname(snap))
        _attempt(report, f"{name}: torchsnapshot Snapshot.restore", _stock_restore, snap, expected)
        _attempt(report, f"{name}: torchsnapshot read_object", _stock_read_object, snap, expected, expected_rng)
        _attempt(report, f"{name}: torchtnt TorchSnapshotSaver.restore", _torchtnt_restore, snap, expected,
                 expected_rng)
    report["plugin modules imported"] = sorted(m for m in sys.modules if m.startswith("tnt_snapshot_plugin"))
    with open(out_json, "w") as f:
        json.dump(report, f)


#: the keys the two-rank snapshot marks replicated; ``per_rank`` differs between the ranks
REPLICATED_KEYS = ("model", "optimizer", "lr_scheduler", *KINDS_KEYS)


def _two_rank_unit(rank: int, *, fresh: bool = False) -> KindsUnit:
    unit = KindsUnit(seed=11 if fresh else 0, fresh=fresh)
    unit.per_rank = Slot({} if fresh else {"rank": rank, "t": torch.full((5,), float(rank)), "s": f"rank {rank}"})
    return unit


def write_two_ranks(rank: int, init_file: str, dirpath: str) -> None:
    import torch.distributed as dist
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        unit = _two_rank_unit(rank)
        saver = TorchSnapshotSaver(
            dirpath if rank == 0 else "", save_every_n_epochs=1, async_snapshot=False,
            replicated=[f"{key}/**" for key in REPLICATED_KEYS],
        )
        train(unit, batches(), max_epochs=1, callbacks=[saver])
        ref = {"state": unit_state(unit), "torch_rng": torch.get_rng_state()}
        torch.save(ref, os.path.join(os.path.dirname(dirpath), f"ref_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def check_two_ranks(out_json: str, dirpath: str) -> None:
    import torchsnapshot

    allow_numpy()
    refs = [torch.load(os.path.join(os.path.dirname(dirpath), f"ref_rank{r}.pt"), weights_only=False) for r in (0, 1)]
    (snap,) = [os.path.join(dirpath, name) for name in os.listdir(dirpath) if name.startswith("epoch_")]
    report: dict[str, list[str]] = {}

    def restore_as_rank0() -> list[str]:
        fresh = _two_rank_unit(0, fresh=True)
        torchsnapshot.Snapshot(snap).restore(dict(fresh.app_state()))
        return differences(refs[0]["state"], unit_state(fresh))

    def read_each_rank() -> list[str]:
        snapshot = torchsnapshot.Snapshot(snap)
        found: list[str] = []
        for rank in (0, 1):
            expected = refs[rank]["state"]
            paths = [(f"{rank}/per_rank/{k}", ("per_rank", k)) for k in ("rank", "t", "s")]
            paths += [(f"{rank}/train_progress/num_steps_completed", ("train_progress", "num_steps_completed"))]
            paths += [(f"{rank}/{p.split('/', 1)[1]}", where) for p, where in SINGLE_ENTRIES]
            for path, where in paths:
                value = expected
                for part in where:
                    value = value[part]
                try:
                    found += differences(value, snapshot.read_object(path), path)
                except Exception as exc:
                    found.append(f"{path}: read_object raised {type(exc).__name__}: {str(exc)[:300]}")
        return found

    _attempt(report, "two ranks: torchsnapshot Snapshot.restore as rank 0", restore_as_rank0)
    _attempt(report, "two ranks: torchsnapshot read_object, each rank's view", read_each_rank)
    report["plugin modules imported"] = sorted(m for m in sys.modules if m.startswith("tnt_snapshot_plugin"))
    with open(out_json, "w") as f:
        json.dump(report, f)


def write_stock(out_dir: str) -> None:
    import torchsnapshot
    from torchsnapshot.knobs import override_max_chunk_size_bytes
    from torchtnt.framework.callbacks import TorchSnapshotSaver as TorchtntSaver
    from torchtnt.framework.train import train

    unit = KindsUnit(seed=1, stock_writable=True)
    saver = TorchtntSaver(os.path.join(out_dir, "torchtnt"), save_every_n_epochs=1, async_checkpoint=False)
    train(unit, batches(), max_epochs=2, callbacks=[saver])
    refs = {"torchtnt": {"state": unit_state(unit), "torch_rng": torch.get_rng_state()}}

    other = KindsUnit(seed=2, stock_writable=True)
    train(other, batches(), max_epochs=1)
    other.prims.state["int"] = 12345  # not the torchtnt snapshot's values
    torch.manual_seed(321)
    app_state = dict(other.app_state())
    app_state["rng_state"] = torchsnapshot.RNGState()
    # 1 MiB chunks: the large tensor is written as a ChunkedTensor (stock does so above 512 MiB)
    with override_max_chunk_size_bytes(1 << 20):
        torchsnapshot.Snapshot.take(os.path.join(out_dir, "stock"), app_state)
    refs["stock"] = {"state": unit_state(other), "torch_rng": torch.get_rng_state()}
    torch.save(refs, os.path.join(out_dir, "refs.pt"))
    assert not [m for m in sys.modules if m.startswith("tnt_snapshot_plugin")]


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "check-plugin-written":
        check_plugin_written(args[0], args[1], args[2:])
    elif mode == "write-two-ranks":
        write_two_ranks(int(args[0]), args[1], args[2])
    elif mode == "check-two-ranks":
        check_two_ranks(args[0], args[1])
    elif mode == "write-stock":
        write_stock(args[0])
    else:
        raise SystemExit(f"unknown mode {mode!r}")
