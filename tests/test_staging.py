"""Staging: a snapshot holds exactly the state of its step while training keeps mutating it, and
the staging buffers are reused from one snapshot to the next.

The plugin's writer writes to the real disk through the real local store; the only thing a test
controls is *when* the background write may proceed: the saver writes through a ``FaultyStore``
around that store (a ``fake://`` dirpath) whose hook holds every payload write until training has
mutated the tensors, so the mutation provably happens while the write runs.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections import OrderedDict

import torch

from tnt_snapshot_plugin import restore
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.saving import staging
from tnt_snapshot_plugin.saving.saver import Snapshotter
from tnt_snapshot_plugin.saving.staging import Stager
from toy import Holder


class Model(torch.nn.Module):
    """Small tensors (packed into shared files by torchsnapshot, copied while it prepares the
    write) and one of 8 MiB (written straight from its memory, so only the plugin's staging copy
    keeps it from changing under the write)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.table = torch.nn.Embedding(2048, 1024)
        self.body = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 3)
        self.register_buffer("seen", torch.zeros(4, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table(torch.arange(x.shape[0]))[:, :8]
        return self.head(torch.relu(self.body(x + rows)))


def train_step(model: Model, optimizer: torch.optim.Optimizer) -> None:
    """Mutates every tensor of the model and the optimizer in place, as training does."""
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    model.seen += 1


def snapshot_values(model: Model, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    values = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in optimizer.state_dict()["state"].items():
        for k, v in state.items():
            values[f"opt.{i}.{k}"] = v.detach().clone()
    return values


class HeldWrites:
    """Makes the background write wait in ``Store.write_payload`` until released."""

    def __init__(self, faulty) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

        def hold(name: str, rel: str) -> None:
            self.started.set()
            assert self.release.wait(30), "the test never released the write"

        faulty.hook("write_payload", before=hold)


def make_snapshotter(dirpath, pm, *, asynchronous: bool = True) -> Snapshotter:
    config = SnapshotConfig.build(
        async_snapshot=asynchronous, save_on_train_end=False, preemption_signals=[]
    )
    return Snapshotter(str(dirpath), config, plugin_manager=pm)


def test_async_snapshot_holds_its_step_while_training_mutates_the_tensors(tmp_path, pm, faulty_local):
    model = Model(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, optimizer)  # the optimizer has state (exp_avg, step) from now on
    faulty, dirpath = faulty_local(tmp_path / "snaps")
    held = HeldWrites(faulty)
    snapshotter = make_snapshotter(dirpath, pm)
    snapshotter.train_start(["model", "optimizer"])

    expected = {}
    for step in (1, 2, 3):
        expected[step] = snapshot_values(model, optimizer)
        held.release.clear()
        held.started.clear()
        assert snapshotter.save(0, step, {"model": model, "optimizer": optimizer})
        # save() returned: the write is on its way and blocked; training goes on meanwhile.
        assert held.started.wait(30)
        for _ in range(3):
            train_step(model, optimizer)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-7.0)  # and a mutation no staging bug could mistake for the old values
        held.release.set()
        snapshotter.wait()

    assert [r.step for r in snapshotter.stats.committed] == [1, 2, 3]
    for record in snapshotter.stats.committed:
        fresh = Model(seed=99)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        train_step(fresh, fresh_opt)
        restore(record.path, {"model": fresh, "optimizer": fresh_opt}, plugin_manager=pm)
        got = snapshot_values(fresh, fresh_opt)
        want = expected[record.step]
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), f"step {record.step}: {key} differs"


def test_sync_snapshot_holds_its_step(tmp_path, pm):
    model = Model(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, optimizer)
    snapshotter = make_snapshotter(tmp_path / "snaps", pm, asynchronous=False)
    snapshotter.train_start(["model", "optimizer"])
    want = snapshot_values(model, optimizer)
    assert snapshotter.save(0, 1, {"model": model, "optimizer": optimizer})
    train_step(model, optimizer)  # after a synchronous save, the files are already complete
    fresh = Model(seed=5)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    train_step(fresh, fresh_opt)
    restore(snapshotter.stats.committed[-1].path, {"model": fresh, "optimizer": fresh_opt}, plugin_manager=pm)
    got = snapshot_values(fresh, fresh_opt)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_snapshotter_reuses_one_staging_copy_across_snapshots(tmp_path, pm):
    model = Model(seed=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    train_step(model, optimizer)
    snapshotter = make_snapshotter(tmp_path / "snaps", pm)
    snapshotter.train_start(["model", "optimizer"])
    stager = snapshotter._stager
    sizes = []
    for step in (1, 2, 3):
        snapshotter.save(0, step, {"model": model, "optimizer": optimizer})
        snapshotter.wait()
        sizes.append(stager.nbytes)
        train_step(model, optimizer)
    state_bytes = sum(v.numel() * v.element_size() for v in snapshot_values(model, optimizer).values())
    assert sizes[0] == sizes[1] == sizes[2]
    assert state_bytes <= sizes[0] < state_bytes + 64 * 1024  # the state plus the small RNG tensors

    # Training over: the staging copy is handed back, and a later snapshot stages again.
    snapshotter.train_end(0, 3, lambda intra_epoch: {"model": model, "optimizer": optimizer})
    assert snapshotter._stager.nbytes == 0
    snapshotter.save(0, 4, {"model": model, "optimizer": optimizer})
    snapshotter.wait()
    assert [r.step for r in snapshotter.stats.committed] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------
# The Stager itself


def pointers(staged: dict) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in staged.items() if isinstance(v, torch.Tensor)}


def test_buffers_are_reused_and_hold_copies_not_the_live_tensors():
    model = Model(seed=3)
    stager = Stager()
    first = stager.stage({"model": model})["model"].state_dict()
    live = model.state_dict()
    assert first.keys() == live.keys()
    for key in live:
        assert torch.equal(first[key], live[key])
        assert first[key].data_ptr() != live[key].data_ptr()
    before = {k: v.clone() for k, v in first.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert all(torch.equal(first[k], before[k]) for k in before)  # the copy did not move

    second = stager.stage({"model": model})["model"].state_dict()
    assert pointers(second) == pointers(first)  # same storage: reused, not reallocated
    assert all(torch.equal(second[k], v) for k, v in model.state_dict().items())
    assert stager.nbytes == sum(v.numel() * v.element_size() for v in live.values())


def test_a_dict_of_cpu_tensors_is_staged_into_one_arena_per_dtype_with_every_value_exact():
    """Shapes of every kind (0-d, empty, 1-D, N-D, a non-contiguous view), three dtypes and a
    tensor that requires grad: each dtype's buffers are consecutive views of one tensor, in
    the dict's order, and every staged value equals its source, at the first stage and at a
    later one that reuses the buffers."""
    gen = torch.Generator().manual_seed(7)
    state = OrderedDict(
        w=torch.randn(4, 3, generator=gen).requires_grad_(),
        b=torch.randn(3, generator=gen),
        step=torch.tensor(11),
        none=torch.empty(0),
        half=torch.randn(5, generator=gen).to(torch.bfloat16),
        t=torch.randn(3, 5, generator=gen).t(),  # not contiguous
        count=torch.arange(6).reshape(2, 3),
        e=torch.randn(2, 2, 2, generator=gen),
    )
    holder = Holder(state)
    stager = Stager()
    first = None
    for _ in range(2):
        staged = stager.stage({"h": holder})["h"].state_dict()
        assert list(staged) == list(state)
        if first is None:
            first = pointers(staged)
        else:
            assert pointers(staged) == first  # the second stage reused the arenas
        for key, value in state.items():
            assert staged[key].shape == value.shape and staged[key].dtype == value.dtype, key
            assert torch.equal(staged[key], value.detach()), key
            assert not staged[key].requires_grad
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            views = [v for v in staged.values() if v.dtype == dtype and v.numel()]
            base = views[0].untyped_storage().data_ptr()
            assert all(v.untyped_storage().data_ptr() == base for v in views)  # one arena
            offsets = [v.storage_offset() for v in views]
            sizes = [v.numel() for v in views]
            assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]  # end to end, in order
        with torch.no_grad():  # training moves on: the staged copy stays as it was
            for value in state.values():
                if value.numel():
                    value.add_(1)
        assert not torch.equal(staged["w"], state["w"].detach())
    assert stager.nbytes == sum(v.numel() * v.element_size() for v in state.values())


def test_a_changed_tensor_is_staged_anew_and_released_buffers_are_not_kept():
    state = OrderedDict(a=torch.arange(6.0), b=torch.ones(3, 2), c=torch.zeros(2, dtype=torch.int32))
    holder = Holder(state)
    stager = Stager()
    stager.stage({"h": holder})

    state["b"] = torch.full((4, 4), 2.0)  # new shape
    state["c"] = torch.ones(2, dtype=torch.float64)  # new dtype
    staged = stager.stage({"h": holder})["h"].state_dict()
    assert type(staged) is OrderedDict and list(staged) == ["a", "b", "c"]
    assert torch.equal(staged["a"], torch.arange(6.0))
    assert stager.nbytes == sum(v.numel() * v.element_size() for v in state.values())  # the old arena let go
    assert torch.equal(staged["b"], torch.full((4, 4), 2.0))
    assert staged["c"].dtype == torch.float64 and torch.equal(staged["c"], torch.ones(2, dtype=torch.float64))

    del state["a"]  # a place that disappears releases its buffer
    state["d"] = torch.tensor(5)
    staged = stager.stage({"h": holder})["h"].state_dict()
    assert list(staged) == ["b", "c", "d"] and staged["d"].item() == 5
    assert stager.nbytes == sum(v.numel() * v.element_size() for v in state.values())


def test_a_dict_whose_type_or_tensor_layout_changed_is_staged_anew():
    """The staged dict is handed out again only while its type, keys, tensor types, shapes,
    dtypes and layouts are unchanged."""
    holder = Holder({"a": torch.arange(9.0).reshape(3, 3)})
    stager = Stager()
    first = stager.stage({"h": holder})["h"].state_dict()
    assert stager.stage({"h": holder})["h"].state_dict() is first  # unchanged: the same staged dict

    holder.state = OrderedDict(a=torch.arange(9.0).reshape(3, 3))
    staged = stager.stage({"h": holder})["h"].state_dict()
    assert type(staged) is OrderedDict and torch.equal(staged["a"], holder.state["a"])

    holder.state = OrderedDict(a=torch.eye(3).to_sparse())  # same shape and dtype, sparse now
    staged = stager.stage({"h": holder})["h"].state_dict()
    assert staged["a"].layout == torch.sparse_coo and torch.equal(staged["a"].to_dense(), torch.eye(3))


def test_nested_containers_views_and_non_tensor_values_are_copied_exactly():
    base = torch.arange(12.0).reshape(3, 4)
    sparse = torch.eye(3).to_sparse()
    state = {
        "view": base.t(),  # non-contiguous: staged as a contiguous copy with the same values
        "scalar": torch.tensor(3.5),
        "nested": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(4.0)}, 1: {"exp_avg": torch.zeros(3)}},
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "pair": (torch.full((2,), 9.0), "tag"),
        "sparse": sparse,
        "count": 7,
    }
    stager = Stager()
    staged = stager.stage({"h": Holder(state)})["h"].state_dict()
    assert torch.equal(staged["view"], base.t()) and staged["view"].is_contiguous()
    assert staged["scalar"].item() == 3.5
    assert torch.equal(staged["nested"][0]["exp_avg"], torch.ones(2))
    assert staged["groups"] == [{"lr": 0.1, "params": [0, 1]}]
    assert staged["groups"] is not state["groups"]
    assert torch.equal(staged["pair"][0], torch.full((2,), 9.0)) and staged["pair"][1] == "tag"
    assert staged["sparse"].is_sparse and torch.equal(staged["sparse"].to_dense(), torch.eye(3))
    assert staged["count"] == 7

    base.mul_(-1)
    state["nested"][0]["exp_avg"].add_(5)
    state["groups"][0]["lr"] = 0.5
    assert torch.equal(staged["view"], torch.arange(12.0).reshape(3, 4).t())
    assert torch.equal(staged["nested"][0]["exp_avg"], torch.ones(2))
    assert staged["groups"][0]["lr"] == 0.1

    again = stager.stage({"h": Holder(state)})["h"].state_dict()
    assert again["nested"][0]["exp_avg"].data_ptr() == staged["nested"][0]["exp_avg"].data_ptr()
    assert torch.equal(again["nested"][0]["exp_avg"], torch.full((2,), 6.0))
    assert torch.equal(again["view"], base.t())


def test_staged_copies_never_join_the_autograd_graph():
    weight = torch.nn.Parameter(torch.randn(3, 3))
    out = (weight * 2).sum()  # a tensor with history, returned by some state_dict
    staged = Stager().stage({"h": Holder({"w": weight, "loss": out})})["h"].state_dict()
    # the Parameter is copied as a new leaf Parameter (saved with its requires_grad), no history
    assert staged["w"].is_leaf and staged["w"].grad_fn is None and staged["w"] is not weight
    assert not staged["loss"].requires_grad and staged["loss"].grad_fn is None


def test_accelerator_path_runs_on_cpu(monkeypatch):
    """The pinned, non-blocking copy path, with CPU tensors standing in for device tensors."""
    waited: list[list[torch.Tensor]] = []
    real_wait = staging._wait_for

    def wait_for(sources: list[torch.Tensor]) -> None:
        waited.append(list(sources))
        real_wait(sources)  # on CPU tensors: no device to synchronise

    monkeypatch.setattr(staging, "_wait_for", wait_for)
    monkeypatch.setattr(Stager, "_on_device", staticmethod(lambda tensor: True))
    model = Model(seed=4)
    stager = Stager()
    first = stager.stage({"model": model})["model"].state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    second = stager.stage({"model": model})["model"].state_dict()
    assert pointers(second) == pointers(first)
    assert all(torch.equal(second[k], v) for k, v in model.state_dict().items())
    assert len(waited) == 2 and len(waited[0]) == len(model.state_dict())
    # pinned only where an accelerator exists to pin for
    assert all(b.is_pinned() == torch.cuda.is_available() for b in second.values())


def test_staging_buffers_exist_from_train_start_and_cover_the_optimizer_after_its_first_step(tmp_path):
    """The first snapshot pays no first touch of new memory: the buffers are allocated and
    touched at train start (the model), and at the first step that does not snapshot (the
    optimizer's state, created by its first step); released at train end."""
    from torchtnt.framework.callback import Callback
    from torchtnt.framework.train import train

    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import StatefulLoader, ToyUnit, make_data

    saver = TorchSnapshotSaver(str(tmp_path / "run"), save_every_n_train_steps=3)
    seen: dict = {}

    class Watch(Callback):
        def on_train_start(self, state, unit) -> None:
            seen["start"] = saver.snapshotter._stager.nbytes
            seen["model"] = sum(t.numel() * t.element_size() for t in unit.model.state_dict().values())

        def on_train_step_end(self, state, unit) -> None:
            if unit.train_progress.num_steps_completed == 1:
                seen["step 1"] = saver.snapshotter._stager.nbytes
                seen["committed"] = len(saver.snapshotter.stats.committed)
                seen["optimizer"] = sum(
                    t.numel() * t.element_size()
                    for s in unit.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
                )

    train(ToyUnit(), StatefulLoader(make_data(16)), max_epochs=1, callbacks=[saver, Watch()])
    assert seen["start"] >= seen["model"] > 0
    assert seen["committed"] == 0  # before any snapshot ...
    assert seen["step 1"] >= seen["model"] + seen["optimizer"]  # ... the optimizer's buffers too
    assert saver.snapshotter._stager.nbytes == 0  # released at train end


def test_prepare_writes_nothing_and_a_synchronous_saver_holds_no_buffers(tmp_path, pm):
    model = Model(0)
    async_saver = Snapshotter(str(tmp_path / "a"), SnapshotConfig.build(), plugin_manager=pm)
    async_saver.train_start(["model"], 0, 0)
    async_saver.prepare(lambda: {"model": model})
    assert async_saver._stager.nbytes >= 2048 * 1024 * 4
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith("epoch_")]
    sync_saver = Snapshotter(str(tmp_path / "s"), SnapshotConfig.build(async_snapshot=False), plugin_manager=pm)
    sync_saver.train_start(["model"], 0, 0)
    sync_saver.prepare(lambda: {"model": model})
    assert sync_saver._stager.nbytes == 0
    async_saver.train_end(0, 0, lambda intra_epoch: {})
    sync_saver.train_end(0, 0, lambda intra_epoch: {})


def test_the_tensors_staged_from_are_let_go_on_the_writer_thread_not_in_the_stall(tmp_path):
    """A module's ``state_dict()`` makes a new tensor object for every tensor; freeing thousands
    of them is milliseconds. The stager hands them to the snapshot, whose writer thread drops
    them: after the snapshot, nothing holds them, and they were freed off the training thread.
    Staging at train start (prepare) keeps none either."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(20)])
    freed_on: list[str] = []

    class Tracked:
        def state_dict(self):
            state = model.state_dict()  # 40 new tensor objects over the parameters
            for tensor in state.values():
                weakref.finalize(tensor, lambda: freed_on.append(threading.current_thread().name))
            return state

        def load_state_dict(self, state):
            model.load_state_dict(state)

    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=True))
    saver.train_start(["m"], 0, 0)
    saver.prepare(lambda: {"m": Tracked()})  # staging buffers made at train start: nothing kept
    gc.collect()
    assert len(freed_on) == 40 and saver._stager.take_sources() is None
    freed_on.clear()
    assert saver.save(0, 1, {"m": Tracked()})
    saver.wait()
    gc.collect()
    assert len(freed_on) == 40
    assert all(name.startswith("tnt-snapshot-") for name in freed_on), set(freed_on)
    assert saver._stager.take_sources() is None  # the stager kept no reference
    saver.train_end(0, 1, lambda intra_epoch: {})


def test_a_tensor_stored_with_torch_save_from_an_arena_writes_its_own_bytes_not_the_arena(tmp_path):
    """An empty or complex tensor is stored with torch.save, which writes a view's whole
    storage: staged as a view of its dict's arena (an async snapshot), its file must hold its
    own bytes only, not the 4 MiB of the arena around it, and restore exactly."""
    import json

    gen = torch.Generator().manual_seed(3)
    state = OrderedDict(
        big=torch.randn(1 << 20, generator=gen),  # 4 MiB of float32, the empty tensor's arena
        empty=torch.empty(0),
        z=torch.randn(64, dtype=torch.complex64, generator=gen),
        zz=torch.randn(1 << 16, dtype=torch.complex64, generator=gen),  # 512 KiB: z's arena
    )
    saver = Snapshotter(str(tmp_path), SnapshotConfig.build(async_snapshot=True))
    saver.train_start(["h"], 0, 0)
    saver.save(0, 1, {"h": Holder(state)})
    saver.train_end(0, 1, lambda intra_epoch: {})
    snapshot = tmp_path / "epoch_0_step_1"
    manifest = json.loads((snapshot / ".snapshot_metadata").read_text())["manifest"]
    for key, limit in (("empty", 4096), ("z", 64 * 8 + 4096)):
        entry = manifest[f"0/h/{key}"]
        assert entry["serializer"] == "torch_save", key
        start, end = entry["byte_range"] or (0, (snapshot / entry["location"]).stat().st_size)
        assert end - start < limit, key  # (packed with other small payloads, or a file of its own)
    target = Holder({k: torch.zeros_like(v) for k, v in state.items()})
    restore(str(snapshot), {"h": target})
    assert all(torch.equal(target.state[k], v) for k, v in state.items())


def test_a_snapshot_taken_in_inference_mode_leaves_buffers_that_later_snapshots_can_fill():
    """Buffers made while a snapshot is staged inside torch.inference_mode() (a hook run during
    evaluation) are normal tensors: an inference tensor refuses the in-place copy of every later
    snapshot taken outside inference mode (RuntimeError), and the other way round works too."""
    module_state = OrderedDict(a=torch.randn(3, 4), b=torch.randn(5))  # a dict of tensors: an arena
    other = {"l": [torch.randn(2), 3]}  # a tensor in a list: a buffer of its own
    app = {"h": Holder(module_state), "g": Holder(other)}
    stager = Stager()
    for inference in (True, False, True, False):
        with torch.no_grad():
            module_state["a"].add_(1)
            other["l"][0].add_(1)
        with torch.inference_mode(inference):
            staged = stager.stage(app)
        assert all(torch.equal(staged["h"].state_dict()[k], v) for k, v in module_state.items())
        assert torch.equal(staged["g"].state_dict()["l"][0], other["l"][0])
        assert not staged["h"].state_dict()["a"].is_inference()


def test_a_changed_dict_lets_go_of_its_old_arena_before_making_the_new_one(monkeypatch):
    """When a dict's layout changes (a buffer registered mid-training), its new arena is made
    after the old one is freed: the two copies of a whole model's state are never held at once."""
    state = OrderedDict(w=torch.randn(256, 256), b=torch.randn(256))
    holder = Holder(state)
    stager = Stager()
    old_arena = weakref.ref(stager.stage({"h": holder})["h"].state_dict()["w"].untyped_storage())
    stager.take_sources()  # as the saver does
    gc.collect()
    assert old_arena() is not None  # held by the stager between snapshots
    alive_when_allocating: list[bool] = []
    real = staging._arena_views

    def watching(values, *rest):
        gc.collect()
        alive_when_allocating.append(old_arena() is not None)
        return real(values, *rest)

    monkeypatch.setattr(staging, "_arena_views", watching)
    state["running_mean"] = torch.zeros(256)  # the layout changes
    staged = stager.stage({"h": holder})["h"].state_dict()
    assert alive_when_allocating == [False]
    assert all(torch.equal(staged[k], v) for k, v in state.items())


def test_a_parameter_is_staged_as_a_parameter_with_its_requires_grad():
    state = {"p": torch.nn.Parameter(torch.randn(3)), "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False)}
    staged = Stager().stage({"h": Holder(state)})["h"].state_dict()
    for key, value in state.items():
        assert type(staged[key]) is torch.nn.Parameter and staged[key] is not value
        assert staged[key].requires_grad == value.requires_grad
        assert staged[key].untyped_storage().data_ptr() != value.untyped_storage().data_ptr()
        assert torch.equal(staged[key].detach(), value.detach())
