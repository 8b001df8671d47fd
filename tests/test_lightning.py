"""The Lightning adapter with real Trainer.fit runs on CPU and real torchsnapshot writes."""

from __future__ import annotations

import os

import pytest
import torch
from dir_listing import staging_by_name, visible_by_name
from lightning_toy import (
    ResumableLoader,
    ToyModule,
    assert_bitwise_equal,
    make_trainer,
    optimizer_tensors,
    plain_loader,
    seed_everything,
    weights,
)
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from tnt_snapshot_plugin import (
    KeyCollisionError,
    NothingToRestoreWarning,
    SnapshotNotFoundError,
    SnapshotsAheadWarning,
    StateMismatchError,
    hookimpl,
)
from tnt_snapshot_plugin.adapters.lightning import (
    LIGHTNING_KEYS,
    SnapshotCheckpointIO,
    TorchSnapshotSaver,
)
from tnt_snapshot_plugin.config import SnapshotConfig
from tnt_snapshot_plugin.demo_data import make_data
from tnt_snapshot_plugin.saving.saver import Snapshotter


def loader(n: int = 40) -> ResumableLoader:
    return ResumableLoader(make_data(n), seed=3)


class Capture(Callback):
    """Records weights, optimizer state and LR after the batch that reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.seen: dict[str, object] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.seen:
            self.seen = {
                "weights": weights(pl_module),
                "optim": optimizer_tensors(trainer),
                "lr": trainer.optimizers[0].param_groups[0]["lr"],
            }


def test_two_epochs_write_named_snapshots_holding_the_lightning_checkpoint(tmp_path):
    capture = Capture(step=4)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), save_every_n_train_steps=2, save_every_n_epochs=1)
    trainer = make_trainer(tmp_path, [capture, saver])
    trainer.fit(ToyModule(), loader(20))  # 5 batches per epoch

    assert visible_by_name(tmp_path / "snaps") == sorted(
        [
            "epoch_0_step_2",
            "epoch_0_step_4",
            "epoch_1_step_5",  # end of epoch 1
            "epoch_1_step_6",
            "epoch_1_step_8",
            "epoch_1_step_10",  # step 10, taken before epoch 2 ended
            "epoch_2_step_10",  # end of epoch 2; on_train_end finds it saved already
        ]
    )
    for name in visible_by_name(tmp_path / "snaps"):
        assert (tmp_path / "snaps" / name / ".snapshot_metadata").is_file()
    assert staging_by_name(tmp_path / "snaps") == []
    assert trainer.checkpoint_callbacks == [saver]  # no default ModelCheckpoint was added

    checkpoint = SnapshotCheckpointIO().load_checkpoint(str(tmp_path / "snaps" / "epoch_0_step_4"))
    assert set(LIGHTNING_KEYS) <= set(checkpoint)
    assert (checkpoint["epoch"], checkpoint["global_step"]) == (0, 4)
    assert_bitwise_equal(checkpoint["state_dict"], capture.seen["weights"])
    saved_optim = {
        f"{i}.{k}": v for i, s in checkpoint["optimizer_states"][0]["state"].items() for k, v in s.items()
    }
    assert_bitwise_equal(saved_optim, capture.seen["optim"])
    assert checkpoint["optimizer_states"][0]["param_groups"][0]["lr"] == capture.seen["lr"]
    fit_loop = checkpoint["loops"]["fit_loop"]
    assert fit_loop["state_dict"]["combined_loader"] == [{"epoch": 0, "position": 4}]
    assert fit_loop["epoch_loop.batch_progress"]["current"]["completed"] == 3  # Lightning: after the hook
    assert saver.state_key in checkpoint["callbacks"]


def test_global_step_counts_optimizer_steps_with_gradient_accumulation(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1, save_on_train_end=False)
    trainer = make_trainer(tmp_path, [saver], accumulate_grad_batches=2)
    trainer.fit(ToyModule(), loader(20))  # 5 batches: steps after batches 2, 4 and 5

    assert trainer.global_step == 6
    # one snapshot per optimizer step, none between the batches of an accumulation window
    assert visible_by_name(tmp_path) == sorted(f"epoch_{s // 4}_step_{s}" for s in range(1, 7))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, object]:
    """The uninterrupted run every resumed run must equal: 2 epochs of 10 batches."""
    seed_everything(7)
    module = ToyModule(seed=0)
    trainer = make_trainer(tmp_path_factory.mktemp("reference"), [], enable_checkpointing=False)
    trainer.fit(module, loader())
    return {"weights": weights(module), "optim": optimizer_tensors(trainer), "step": trainer.global_step}


@pytest.mark.parametrize(
    "fail_at_step, ckpt_path, resumed_from",
    [
        (7, "last", "epoch_0_step_6"),  # mid-epoch 1
        (10, "last", "epoch_1_step_10"),  # at the epoch boundary
        (13, "last", "epoch_1_step_12"),  # mid-epoch 2
        (13, "epoch_0_step_9", "epoch_0_step_9"),  # an explicit, older snapshot
        (13, "epoch_1_step_10", "epoch_1_step_10"),
    ],
)
def test_resume_in_a_fresh_trainer_is_bitwise_identical(
    tmp_path, reference, fail_at_step, ckpt_path, resumed_from
):
    dirpath = str(tmp_path / "snaps")
    seed_everything(7)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=3, save_every_n_epochs=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(ToyModule(seed=0, fail_at_step=fail_at_step), loader())

    # A new process: other seeds, a freshly initialised module, a new loader, a new Trainer.
    seed_everything(999)
    module = ToyModule(seed=42)
    trainer = make_trainer(
        tmp_path, [TorchSnapshotSaver(dirpath, save_every_n_train_steps=3, save_every_n_epochs=1)]
    )
    path = ckpt_path if ckpt_path == "last" else os.path.join(dirpath, ckpt_path)
    trainer.fit(module, loader(), ckpt_path=path)

    assert trainer.ckpt_path == os.path.join(dirpath, resumed_from)
    assert_bitwise_equal(weights(module), reference["weights"])
    assert_bitwise_equal(optimizer_tensors(trainer), reference["optim"])
    assert (trainer.global_step, trainer.current_epoch) == (reference["step"], 2)


def test_epoch_boundary_resume_with_a_plain_shuffling_dataloader(tmp_path):
    """A DataLoader(shuffle=True) draws its order from the global RNG, which the snapshot holds."""
    seed_everything(7)
    expected = ToyModule(seed=0)
    make_trainer(tmp_path, [], enable_checkpointing=False).fit(expected, plain_loader())

    seed_everything(7)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), save_every_n_epochs=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver]).fit(ToyModule(seed=0, fail_at_step=7), plain_loader())

    seed_everything(3)
    module = ToyModule(seed=5)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), save_every_n_epochs=1)
    trainer = make_trainer(tmp_path, [saver])
    trainer.fit(module, plain_loader(), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "snaps" / "epoch_1_step_5")
    assert_bitwise_equal(weights(module), weights(expected))


def _recorded(name):
    def hook(self, trainer, *args, **kwargs):
        self.calls.append((name, trainer.global_step))
        return getattr(TorchSnapshotSaver, name)(self, trainer, *args, **kwargs)

    return hook


class Recorder(TorchSnapshotSaver):
    """Records the saver's hooks (with the global step) and its state_dict calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, object]] = []

    setup = _recorded("setup")
    on_train_start = _recorded("on_train_start")
    on_train_batch_end = _recorded("on_train_batch_end")
    on_train_epoch_end = _recorded("on_train_epoch_end")
    on_train_end = _recorded("on_train_end")
    on_exception = _recorded("on_exception")
    teardown = _recorded("teardown")

    def state_dict(self):
        self.calls.append(("state_dict", None))
        return super().state_dict()

    def load_state_dict(self, state_dict):
        self.calls.append(("load_state_dict", None))
        super().load_state_dict(state_dict)


class Committed:
    def __init__(self, calls):
        self.calls = calls

    @hookimpl
    def tnt_snapshot_plugin_snapshot_committed(self, path, epoch, step):
        self.calls.append(("committed", os.path.basename(path)))


def test_hook_order(tmp_path, pm):
    saver = Recorder(
        str(tmp_path / "s"), save_every_n_train_steps=2, save_every_n_epochs=1, plugin_manager=pm
    )
    pm.register(Committed(saver.calls))
    make_trainer(tmp_path, [saver], max_epochs=1).fit(ToyModule(), loader(12))  # 3 batches
    assert saver.calls == [
        ("setup", 0),
        ("on_train_start", 0),
        ("on_train_batch_end", 1),
        ("on_train_batch_end", 2),
        ("state_dict", None),  # the snapshot of step 2 holds the saver's own state
        ("on_train_batch_end", 3),
        ("on_train_epoch_end", 3),
        ("committed", "epoch_0_step_2"),  # reaped before the next snapshot is staged
        ("state_dict", None),
        ("on_train_end", 3),  # epoch_1_step_3 is saved already: no third snapshot
        ("committed", "epoch_1_step_3"),
        ("teardown", 3),
    ]

    # an exception: the pending snapshot is committed, and Lightning calls no teardown hook
    saver = Recorder(str(tmp_path / "t"), save_every_n_train_steps=2, plugin_manager=pm)
    pm.register(Committed(saver.calls))
    with pytest.raises(RuntimeError, match="injected failure"):
        make_trainer(tmp_path, [saver], max_epochs=1).fit(ToyModule(fail_at_step=2), loader(12))
    assert saver.calls == [
        ("setup", 0),
        ("on_train_start", 0),
        ("on_train_batch_end", 1),
        ("on_train_batch_end", 2),
        ("state_dict", None),
        ("on_exception", 2),
        ("committed", "epoch_0_step_2"),
    ]

    # resuming: Lightning hands the saver its state before training starts
    saver = Recorder(str(tmp_path / "s"), save_every_n_epochs=1, plugin_manager=pm)
    with pytest.warns(SnapshotsAheadWarning, match=r"ahead of this run's progress \(epoch 0, step 2\): epoch_1_step_3"):
        make_trainer(tmp_path, [saver], max_epochs=1).fit(
            ToyModule(), loader(12), ckpt_path=str(tmp_path / "s" / "epoch_0_step_2")
        )
    assert saver.calls[:4] == [
        ("setup", 0),
        ("load_state_dict", None),
        ("on_train_start", 2),
        ("on_train_batch_end", 3),
    ]


def test_state_dict_round_trip_and_two_savers_with_different_cadences(tmp_path):
    # synchronous, so that its snapshot is committed when the other saver records its state
    steps = TorchSnapshotSaver(
        str(tmp_path / "steps"), save_every_n_train_steps=2, save_on_train_end=False, async_snapshot=False
    )
    epochs = TorchSnapshotSaver(str(tmp_path / "epochs"), save_every_n_epochs=1)
    assert steps.state_key != epochs.state_key
    trainer = make_trainer(tmp_path, [steps, epochs])
    trainer.fit(ToyModule(), loader(12))  # 3 batches per epoch

    assert visible_by_name(tmp_path / "steps") == ["epoch_0_step_2", "epoch_1_step_4", "epoch_1_step_6"]
    assert visible_by_name(tmp_path / "epochs") == ["epoch_1_step_3", "epoch_2_step_6"]
    state = steps.state_dict()
    assert state == {
        "dirpath": str(tmp_path / "steps"),
        "last_committed": str(tmp_path / "steps" / "epoch_1_step_6"),
    }
    fresh = TorchSnapshotSaver(str(tmp_path / "steps"))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state

    # Each saver gets its own state back from a snapshot that holds both.
    steps_again = TorchSnapshotSaver(str(tmp_path / "steps"), save_every_n_train_steps=2)
    epochs_again = TorchSnapshotSaver(str(tmp_path / "epochs"), save_every_n_epochs=1)
    make_trainer(tmp_path, [steps_again, epochs_again], max_epochs=1).fit(
        ToyModule(), loader(12), ckpt_path=str(tmp_path / "epochs" / "epoch_1_step_3")
    )
    assert steps_again.state_dict()["last_committed"] == str(tmp_path / "steps" / "epoch_0_step_2")
    assert epochs_again.state_dict()["last_committed"] is None  # its first snapshot was not committed yet

    # Two savers on one dirpath would race: Lightning refuses the duplicate state key.
    with pytest.raises(RuntimeError, match="state_key"):
        make_trainer(
            tmp_path, [TorchSnapshotSaver(str(tmp_path / "x")), TorchSnapshotSaver(str(tmp_path / "x"))]
        )


def test_restore_outside_fit(tmp_path):
    capture = Capture(step=3)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=3)
    trainer = make_trainer(tmp_path, [capture, saver], max_epochs=1)
    trainer.fit(ToyModule(), loader(20))

    module = ToyModule(seed=9)
    optimizer_config = module.configure_optimizers()
    optimizer, scheduler = optimizer_config["optimizer"], optimizer_config["lr_scheduler"]["scheduler"]
    TorchSnapshotSaver.restore(
        str(tmp_path / "epoch_0_step_3"), module, optimizers=[optimizer], lr_schedulers=[scheduler]
    )
    assert_bitwise_equal(weights(module), capture.seen["weights"])
    restored = {
        f"{i}.{k}": v
        for i, s in optimizer.state_dict()["state"].items()
        for k, v in s.items()
        if torch.is_tensor(v)
    }
    assert_bitwise_equal(restored, capture.seen["optim"])

    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), module)
    assert_bitwise_equal(weights(module), weights(trainer.lightning_module))  # epoch_1_step_5, the final one
    (tmp_path / "empty").mkdir()
    with pytest.warns(NothingToRestoreWarning, match="is empty"):
        assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "empty"), module) is False

    with pytest.raises(StateMismatchError, match="holds 1 optimizer states, 2 were given"):
        TorchSnapshotSaver.restore(
            str(tmp_path / "epoch_0_step_3"), module, optimizers=[optimizer, optimizer]
        )
    other = ToyModule()
    other.net[0] = torch.nn.Linear(4, 32)
    with pytest.raises(StateMismatchError, match=r"net\.0\.weight: shape \[32, 4\] in the module"):
        TorchSnapshotSaver.restore(str(tmp_path / "epoch_0_step_3"), other)
    with pytest.raises(SnapshotNotFoundError, match="does not exist"):
        TorchSnapshotSaver.restore(str(tmp_path / "epoch_9_step_99"), module)


def test_coexists_with_model_checkpoint_and_last_takes_the_newest(tmp_path):
    model_checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), save_every_n_epochs=1)
    make_trainer(tmp_path, [model_checkpoint, saver]).fit(ToyModule(), loader(12))
    last_ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert last_ckpt.is_file()
    assert visible_by_name(tmp_path / "snaps") == ["epoch_1_step_3", "epoch_2_step_6"]

    def resume(ckpt_path, max_epochs=3):
        trainer = make_trainer(
            tmp_path,
            [
                ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True),
                TorchSnapshotSaver(str(tmp_path / "snaps")),
            ],
            max_epochs=max_epochs,
        )
        trainer.fit(ToyModule(seed=1), loader(12), ckpt_path=ckpt_path)
        return trainer

    # "last" is the most recently modified of last.ckpt and the newest snapshot
    os.utime(last_ckpt, (1, 1))
    assert resume("last", max_epochs=2).ckpt_path == str(tmp_path / "snaps" / "epoch_2_step_6")
    os.utime(last_ckpt)
    assert resume("last", max_epochs=2).ckpt_path == str(last_ckpt)
    # explicit paths of either kind load (the .ckpt through Lightning's own CheckpointIO)
    assert resume(str(last_ckpt)).global_step == 9
    assert resume(str(tmp_path / "snaps" / "epoch_1_step_3")).global_step == 9


def test_checkpoint_io_without_the_saver_and_in_validate(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_epochs=1)
    make_trainer(tmp_path, [saver], max_epochs=1).fit(ToyModule(), loader(12))
    snapshot = str(tmp_path / "epoch_1_step_3")

    trainer = make_trainer(
        tmp_path, [], max_epochs=2, plugins=[SnapshotCheckpointIO()], enable_checkpointing=False
    )
    trainer.fit(ToyModule(seed=1), loader(12), ckpt_path=snapshot)
    assert trainer.global_step == 6

    class Validating(ToyModule):
        def validation_step(self, batch, batch_idx):
            self.seen_weights = weights(self)

    module = Validating(seed=2)
    make_trainer(tmp_path, [TorchSnapshotSaver(str(tmp_path))]).validate(
        module, loader(4), ckpt_path=snapshot
    )
    assert_bitwise_equal(module.seen_weights, weights(saver_module_at(snapshot)))

    # a snapshot another adapter wrote is not a Lightning checkpoint
    other = str(tmp_path / "other")
    Snapshotter(other, SnapshotConfig.build(async_snapshot=False)).save(
        0, 1, {"model": torch.nn.Linear(2, 2)}
    )
    with pytest.raises(StateMismatchError, match="holds no Lightning checkpoint"):
        SnapshotCheckpointIO().load_checkpoint(os.path.join(other, "epoch_0_step_1"))


def saver_module_at(snapshot: str) -> ToyModule:
    module = ToyModule(seed=3)
    TorchSnapshotSaver.restore(snapshot, module)
    return module


def test_reserved_key_from_on_save_checkpoint_is_refused(tmp_path):
    class Clashing(ToyModule):
        def on_save_checkpoint(self, checkpoint):
            checkpoint["rng_state"] = 1

    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=1)
    with pytest.raises(KeyCollisionError, match="rng_state"):
        make_trainer(tmp_path, [saver], max_epochs=1).fit(Clashing(), loader(8))
    assert visible_by_name(tmp_path) == []


def test_synchronous_snapshots_write_the_same_names(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, async_snapshot=False)
    make_trainer(tmp_path, [saver], max_epochs=1).fit(ToyModule(), loader(12))
    assert visible_by_name(tmp_path) == ["epoch_0_step_2", "epoch_1_step_3"]
    assert saver.dirpath == str(tmp_path)


def test_demo_resumes_bitwise(tmp_path):
    from tnt_snapshot_plugin.hooks import adapters

    demo = adapters()["lightning"].load_demo()
    report = demo(str(tmp_path), epochs=2, steps_per_epoch=6, interrupt_at=8)
    assert report["interrupted"] == "simulated crash before step 9"
    assert [os.path.basename(r.path) for r in report["saved"]] == [
        "epoch_0_step_2",
        "epoch_0_step_4",
        "epoch_0_step_6",
        "epoch_1_step_6",
        "epoch_1_step_8",
    ]
    assert (report["resumed_from"], report["restored_epoch"], report["restored_step"]) == (
        str(tmp_path / "epoch_1_step_8"),
        1,
        8,
    )
    assert report["final_step"] == 12
    assert report["bitwise_identical"] is True


def test_pickles_for_ddp_spawn_as_its_arguments(tmp_path, pm):
    import pickle

    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=4, keep_last_n_snapshots=2)
    saver.load_state_dict({"last_committed": "x"})
    copy = pickle.loads(pickle.dumps(saver))
    assert (copy.dirpath, copy.state_key, copy.state_dict()) == (
        saver.dirpath,
        saver.state_key,
        saver.state_dict(),
    )
    assert copy.snapshotter.config == saver.snapshotter.config
    with pytest.raises(TypeError, match="own process_group or plugin_manager"):
        pickle.dumps(TorchSnapshotSaver(str(tmp_path), plugin_manager=pm))


def test_fsdp_strategy_refuses_to_resume_from_a_snapshot_at_setup(tmp_path):
    """Lightning's FSDPStrategy loads ckpt_path itself, bypassing the CheckpointIO; Lightning
    allows it only with GPUs, so the trainer here is a CPU one given a real FSDPStrategy the way
    Lightning's connector holds it. The saver says so at setup instead of Lightning failing later."""
    from pytorch_lightning.strategies import FSDPStrategy

    from tnt_snapshot_plugin import ConfigError

    saver = TorchSnapshotSaver(str(tmp_path / "snaps"))
    trainer = make_trainer(tmp_path, [saver])
    module = ToyModule()
    saver.setup(trainer, module, "fit")  # the CPU strategy: nothing to refuse
    trainer._accelerator_connector.strategy = FSDPStrategy()
    saver.setup(trainer, module, "fit")  # FSDP without a snapshot to resume: fine
    trainer._checkpoint_connector._ckpt_path = str(tmp_path / "snaps" / "epoch_1_step_4")
    with pytest.raises(ConfigError, match='strategy="fsdp"'):
        saver.setup(trainer, module, "fit")
