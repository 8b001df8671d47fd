"""Switching from ``ModelCheckpoint`` to the Lightning ``TorchSnapshotSaver`` with the same arguments.

Each test trains real ``pytorch_lightning.Trainer`` runs on CPU, one with Lightning's
``ModelCheckpoint`` and one with the saver given the same arguments, and compares what each keeps
on disk (by global step), ``best_model_path`` and ``best_model_score``, and the errors for
invalid arguments. The expectations come from ``ModelCheckpoint``'s documentation and source.
Where the saver deliberately differs (the newest snapshot is always kept; ``save_top_k`` without
``monitor`` defaults to keeping every snapshot; ``save_top_k=0`` is refused), a test pins it.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from dir_listing import visible_by_name
from lightning_fabric.utilities.exceptions import MisconfigurationException
from lightning_toy import ResumableLoader, ToyModule, make_trainer, seed_everything
from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from pytorch_lightning.loggers import CSVLogger

from tnt_snapshot_plugin import ConfigError
from tnt_snapshot_plugin.adapters.lightning import InvalidArgumentError, TorchSnapshotSaver
from tnt_snapshot_plugin.demo_data import make_data
from tnt_snapshot_plugin.naming import SnapshotName

README = Path(__file__).resolve().parent.parent / "README.md"


def loader(n: int = 12) -> ResumableLoader:
    return ResumableLoader(make_data(n), seed=3)  # batches of 4


class Logs(ToyModule):
    """Logs ``values[current_epoch]`` as ``name`` at each validation."""

    def __init__(self, values: list[float], name: str = "val_loss", seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.values = values
        self.metric = name

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log(self.metric, self.values[min(self.trainer.current_epoch, len(self.values) - 1)])


def fit(tmp: Path, callback: Any, module: Optional[ToyModule] = None, *, max_epochs: int = 2,
        n: int = 12, ckpt_path: Optional[str] = None, **trainer_args: Any) -> Any:
    seed_everything(0)
    trainer_args.setdefault("limit_val_batches", 1)
    trainer = make_trainer(tmp, [callback], max_epochs=max_epochs, **trainer_args)
    trainer.fit(module if module is not None else ToyModule(), loader(n), loader(4), ckpt_path=ckpt_path)
    return trainer


def step_of(path: str) -> int:
    """The global step a checkpoint file or snapshot directory was saved at."""
    name = os.path.basename(path)
    parsed = SnapshotName.parse(name)
    if parsed is not None:
        return parsed.step
    found = re.search(r"step=(\d+)", name)
    assert found, name
    return int(found.group(1))


def kept(dirpath: Any) -> list[int]:
    """The global steps of the checkpoints (``.ckpt``) or snapshots kept in ``dirpath``."""
    names = [n for n in visible_by_name(dirpath) if n.endswith(".ckpt") or SnapshotName.parse(n)]
    return sorted(step_of(n) for n in names)


def both(
    tmp_path: Path, module_factory: Any = ToyModule, max_epochs: int = 2, **arguments: Any
) -> tuple[Any, Any]:
    """(ModelCheckpoint, saver), each given ``arguments`` and trained on the same run."""
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), **arguments)
    fit(tmp_path, mc, module_factory(), max_epochs=max_epochs)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), **arguments)
    fit(tmp_path, saver, module_factory(), max_epochs=max_epochs)
    return mc, saver


@contextmanager
def lightning_log() -> Iterator[list[str]]:
    """The lines Lightning's loggers (``rank_zero_info``) emit meanwhile."""
    lines: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Handler(logging.INFO)
    target = logging.getLogger("pytorch_lightning")
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        target.removeHandler(handler)
        target.setLevel(level)


# -- the README's switch --------------------------------------------------------------------------


def _readme_switch_block() -> str:
    text = README.read_text()
    section = text[text.index("## Lightning quickstart") : text.index("\n## ", text.index("## Lightning quickstart") + 5)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    switch = [b for b in blocks if "ModelCheckpoint(" in b and "TorchSnapshotSaver(" in b]
    assert len(switch) == 1, "the Lightning section shows the switch from ModelCheckpoint in one block"
    return switch[0]


def test_readme_switch_runs_verbatim_and_keeps_what_model_checkpoint_keeps(tmp_path, monkeypatch):
    block = _readme_switch_block()
    lines = block.splitlines()
    saver_lines = [line for line in lines if "TorchSnapshotSaver(" in line and "import" not in line]
    mc_lines = [line for line in lines if "ModelCheckpoint(" in line and "import" not in line]
    assert len(saver_lines) == 1 and len(mc_lines) == 1
    # the switch is one line: the same arguments, the class name changed
    assert saver_lines[0].split("TorchSnapshotSaver(")[1].split(")")[0] == (
        mc_lines[0].split("ModelCheckpoint(")[1].split(")")[0]
    )

    def run(source: str, where: Path) -> dict[str, Any]:
        where.mkdir()
        monkeypatch.chdir(where)  # default_root_dir: ModelCheckpoint's and the saver's dirpath default
        namespace: dict[str, Any] = {}
        exec(compile(source, str(README), "exec"), namespace)
        seed_everything(0)
        namespace["trainer"].fit(Logs([0.5, 0.3, 0.4, 0.6, 0.45]), loader(), loader(4))
        return namespace

    ours = run(block, tmp_path / "switched")  # verbatim: the saver line comes last
    theirs = run("\n".join(line for line in lines if line not in saver_lines), tmp_path / "before")
    saver, mc = ours["checkpoint"], theirs["checkpoint"]
    assert isinstance(saver, TorchSnapshotSaver) and type(mc) is ModelCheckpoint

    # both defaulted dirpath under the Trainer's directory, as ModelCheckpoint does
    assert os.path.relpath(saver.dirpath, tmp_path / "switched") == os.path.relpath(mc.dirpath, tmp_path / "before")
    assert step_of(saver.best_model_path) == step_of(mc.best_model_path) == 6
    assert float(saver.best_model_score) == float(mc.best_model_score) == pytest.approx(0.3)
    # ModelCheckpoint's top 2 (0.3, 0.4), and the newest snapshot, which the saver always keeps
    assert kept(mc.dirpath) == [6, 9]
    assert kept(saver.dirpath) == [6, 9, 15]


# -- arguments and their errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        dict(mode="avg"),
        dict(monitor="val_loss", mode="average"),
        dict(save_top_k=-2),
        dict(monitor="val_loss", save_top_k=-3),
        dict(save_top_k=2),
        dict(save_top_k=3),
        dict(every_n_epochs=-1),
        dict(every_n_train_steps=-2),
    ],
)
def test_arguments_model_checkpoint_refuses_are_refused_alike(tmp_path, arguments):
    with pytest.raises(MisconfigurationException):
        ModelCheckpoint(dirpath=str(tmp_path / "mc"), **arguments)
    with pytest.raises(InvalidArgumentError) as caught:
        TorchSnapshotSaver(str(tmp_path / "snaps"), **arguments)
    assert isinstance(caught.value, MisconfigurationException) and isinstance(caught.value, ConfigError)
    name = next(iter(k for k in arguments if k != "monitor"))
    assert str(caught.value).startswith(name) or f"{name}=" in str(caught.value)
    assert not (tmp_path / "snaps").exists()


def test_mode_is_validated_without_monitor(tmp_path):
    with pytest.raises(InvalidArgumentError, match="mode must be 'min' or 'max', got 'lowest'"):
        TorchSnapshotSaver(str(tmp_path), mode="lowest")


@pytest.mark.parametrize(
    ("name", "value", "instead"),
    [
        ("filename", "{epoch}-{val_loss:.2f}", "snapshot names are fixed"),
        ("save_weights_only", True, r"TorchSnapshotSaver\.restore\(path, model\)"),
        ("auto_insert_metric_name", False, "always in the snapshot's name"),
        ("enable_version_counter", False, "never collide"),
        ("save_on_exception", True, "preemption_signals"),
    ],
)
def test_model_checkpoint_arguments_without_meaning_here_say_so(tmp_path, name, value, instead):
    ModelCheckpoint(dirpath=str(tmp_path / "mc"), **{name: value})  # accepted there
    with pytest.raises(ConfigError, match=rf"{name}=.*has no meaning for a snapshot saver: .*{instead}"):
        TorchSnapshotSaver(str(tmp_path / "snaps"), **{name: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'save_evry_n_epochs'"):
        TorchSnapshotSaver(str(tmp_path / "snaps"), save_evry_n_epochs=1)
    assert not (tmp_path / "snaps").exists()


def test_save_top_k_zero_is_refused_a_deliberate_difference(tmp_path):
    ModelCheckpoint(dirpath=str(tmp_path), save_top_k=0)  # there: save nothing
    with pytest.raises(ConfigError, match=r"save_top_k=0 .* leave the saver out"):
        TorchSnapshotSaver(str(tmp_path), save_top_k=0)


# -- cadences -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments",
    [
        dict(every_n_train_steps=2, every_n_epochs=0),  # 0: off, so the step cadence alone
        dict(every_n_train_steps=0, every_n_epochs=1),
        dict(every_n_train_steps=2, save_top_k=-1),
        dict(),  # neither: every epoch
        dict(every_n_epochs=2, save_top_k=-1),
    ],
)
def test_cadences_and_zero_meaning_off_save_what_model_checkpoint_saves(tmp_path, arguments):
    arguments = dict(arguments)
    arguments.setdefault("save_top_k", -1)
    both(tmp_path, **arguments)
    max_epochs_steps = 6  # 3 batches an epoch, 2 epochs
    assert kept(tmp_path / "mc")
    assert kept(tmp_path / "snaps") == kept(tmp_path / "mc")
    assert max(kept(tmp_path / "snaps")) <= max_epochs_steps


def test_every_n_train_steps_zero_alone_means_no_periodic_snapshots(tmp_path):
    # ModelCheckpoint: every_n_train_steps=0 (given) turns the default epoch cadence off too, so
    # it saves nothing; the saver takes only its final snapshot (save_on_train_end).
    mc, saver = both(tmp_path, every_n_train_steps=0)
    assert kept(tmp_path / "mc") == []
    assert kept(tmp_path / "snaps") == [6]
    saver = TorchSnapshotSaver(str(tmp_path / "none"), every_n_train_steps=0, save_on_train_end=False)
    fit(tmp_path, saver)
    assert not (tmp_path / "none").exists() or kept(tmp_path / "none") == []


def test_save_on_train_epoch_end_false_saves_after_each_validation_like_model_checkpoint(tmp_path):
    arguments = dict(every_n_epochs=1, save_on_train_epoch_end=False, save_top_k=-1)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), **arguments)
    # 4 batches an epoch: validation after batches 2 and 4
    fit(tmp_path, mc, Logs([0.5]), n=16, val_check_interval=0.5)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), **arguments)
    fit(tmp_path, saver, Logs([0.5]), n=16, val_check_interval=0.5)
    assert kept(tmp_path / "mc") == [2, 4, 6, 8]
    assert kept(tmp_path / "snaps") == [2, 4, 6, 8]
    # mid-epoch validations name the epoch they ran in; epoch-end ones the epochs completed
    assert visible_by_name(tmp_path / "snaps") == [
        "epoch_0_step_2", "epoch_1_step_4", "epoch_1_step_6", "epoch_2_step_8"
    ]


def test_train_end_does_not_save_the_last_step_again(tmp_path):
    saver = TorchSnapshotSaver(str(tmp_path), every_n_train_steps=3)  # the epoch's last batch
    fit(tmp_path, saver)
    # not also epoch_1_step_3 / epoch_2_step_6: the same state under the next epoch's number
    assert visible_by_name(tmp_path) == ["epoch_0_step_3", "epoch_1_step_6"]
    saver = TorchSnapshotSaver(str(tmp_path / "two"), every_n_train_steps=4)
    fit(tmp_path, saver)  # step 6 is not on the cadence: the final snapshot is new state
    assert visible_by_name(tmp_path / "two") == ["epoch_1_step_4", "epoch_2_step_6"]


# -- save_top_k and monitor -----------------------------------------------------------------------


@pytest.mark.parametrize(("save_top_k", "steps"), [(1, [6]), (-1, [2, 4, 6])])
def test_save_top_k_without_monitor_keeps_the_latest_or_all(tmp_path, save_top_k, steps):
    mc, saver = both(tmp_path, every_n_train_steps=2, save_top_k=save_top_k)
    assert kept(tmp_path / "mc") == steps
    assert kept(tmp_path / "snaps") == steps
    # without monitor, ModelCheckpoint's best_model_path is the newest checkpoint it saved
    assert step_of(saver.best_model_path) == step_of(mc.best_model_path) == steps[-1]
    assert saver.best_model_score is None and mc.best_model_score is None


def test_save_top_k_without_monitor_defaults_to_keeping_every_snapshot(tmp_path):
    # A deliberate difference: ModelCheckpoint's default save_top_k=1 keeps only the latest
    # checkpoint; a snapshot saver deletes resume points only when asked to.
    mc, saver = both(tmp_path, every_n_train_steps=2)
    assert kept(tmp_path / "mc") == [6]
    assert kept(tmp_path / "snaps") == [2, 4, 6]


def test_monitor_step_and_epoch_rank_like_model_checkpoint(tmp_path):
    mc, saver = both(tmp_path, every_n_train_steps=2, monitor="step", mode="max", save_top_k=2)
    assert kept(tmp_path / "mc") == kept(tmp_path / "snaps") == [4, 6]
    assert float(saver.best_model_score) == float(mc.best_model_score) == 6
    assert step_of(saver.best_model_path) == step_of(mc.best_model_path) == 6
    assert os.path.basename(saver.best_model_path) == "epoch_1_step_6_step=6.0"

    epochs = tmp_path / "epochs"
    epochs.mkdir()
    mc, saver = both(epochs, monitor="epoch", mode="max", save_top_k=1, every_n_epochs=1)
    assert kept(epochs / "mc") == kept(epochs / "snaps") == [6]
    # ModelCheckpoint's "epoch" is trainer.current_epoch: 1 in the second epoch
    assert float(saver.best_model_score) == float(mc.best_model_score) == 1


def test_a_logged_step_or_epoch_is_used_as_model_checkpoint_uses_it(tmp_path):
    class LogsStep(ToyModule):
        def validation_step(self, batch, batch_idx):
            self.log("step", 100.0 - self.trainer.current_epoch)

    mc, saver = both(tmp_path, lambda: LogsStep(), monitor="step", mode="min", save_top_k=1)
    assert float(saver.best_model_score) == float(mc.best_model_score) == 99
    # the second epoch's: ModelCheckpoint's file name shows the logged step too
    assert os.path.basename(mc.best_model_path) == "epoch=1-step=99.ckpt"
    assert os.path.basename(saver.best_model_path) == "epoch_2_step_6_step=99.0"


@pytest.mark.parametrize(
    ("values", "mode", "best_step", "score"),
    [
        ([math.nan, 0.3, math.nan], "min", 6, 0.3),
        ([math.nan, math.nan], "min", 3, math.inf),
        ([math.nan, math.nan], "max", 3, -math.inf),
        ([0.2, math.nan], "max", 3, 0.2),
    ],
)
def test_a_nan_ranks_worst_and_reads_as_model_checkpoint_reports_it(tmp_path, values, mode, best_step, score):
    epochs = len(values)
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), monitor="val_loss", mode=mode, save_top_k=1)
    fit(tmp_path, mc, Logs(values), max_epochs=epochs)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), monitor="val_loss", mode=mode, save_top_k=1)
    fit(tmp_path, saver, Logs(values), max_epochs=epochs)
    assert float(mc.best_model_score) == pytest.approx(score)
    assert float(saver.best_model_score) == pytest.approx(score)
    assert step_of(saver.best_model_path) == step_of(mc.best_model_path) == best_step
    # the snapshot's name keeps the value logged
    if math.isnan(values[best_step // 3 - 1]):
        assert saver.best_model_path.endswith("val_loss=nan")


def test_the_newest_snapshot_is_always_kept_a_deliberate_difference(tmp_path):
    mc, saver = both(tmp_path, lambda: Logs([0.3, 0.5, 0.6]), monitor="val_loss", save_top_k=1)
    # ModelCheckpoint never writes a checkpoint outside the top k; the saver keeps the newest
    # snapshot too (ckpt_path="last" resumes it) until a newer one is committed.
    assert kept(tmp_path / "mc") == [3]
    assert kept(tmp_path / "snaps") == [3, 6]


def test_the_snapshot_a_run_resumed_from_is_never_deleted(tmp_path):
    values = [0.5, 0.3, 0.4, 0.6]
    # a first run keeps every epoch's checkpoint
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), monitor="val_loss", save_top_k=-1)
    fit(tmp_path, mc, Logs(values), max_epochs=1)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), monitor="val_loss", save_top_k=-1)
    fit(tmp_path, saver, Logs(values), max_epochs=1)
    (mc_first,) = visible_by_name(tmp_path / "mc")
    (first,) = visible_by_name(tmp_path / "snaps")
    assert first == "epoch_1_step_3_val_loss=0.5"

    # the resumed run keeps the best 1: its own 0.3 is better than the 0.5 it resumed from
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), monitor="val_loss", save_top_k=1)
    fit(tmp_path, mc, Logs(values), max_epochs=4, ckpt_path=str(tmp_path / "mc" / mc_first))
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), monitor="val_loss", save_top_k=1)
    trainer = fit(tmp_path, saver, Logs(values), max_epochs=4, ckpt_path=str(tmp_path / "snaps" / first))
    assert trainer.ckpt_path == str(tmp_path / "snaps" / first)
    assert mc_first in visible_by_name(tmp_path / "mc")  # ModelCheckpoint keeps it...
    assert first in visible_by_name(tmp_path / "snaps")  # ...and so does the saver
    assert step_of(saver.best_model_path) == step_of(mc.best_model_path) == 6
    # the protection lasts for the run that resumed from it: a later run deletes it
    later = TorchSnapshotSaver(str(tmp_path / "snaps"), monitor="val_loss", save_top_k=1)
    fit(tmp_path, later, Logs([0.2]), max_epochs=5, ckpt_path=later.ckpt_path)
    assert first not in visible_by_name(tmp_path / "snaps")


# -- dirpath, verbose, save_last ------------------------------------------------------------------


@pytest.mark.parametrize("with_logger", [False, True])
def test_dirpath_defaults_where_model_checkpoint_puts_it(tmp_path, with_logger):
    def logger(where: Path) -> Any:
        return CSVLogger(str(where / "logs"), name="run") if with_logger else False

    mc = ModelCheckpoint(save_top_k=-1)
    fit(tmp_path / "mc", mc, logger=logger(tmp_path / "mc"))
    saver = TorchSnapshotSaver(save_top_k=-1)
    assert saver.dirpath is None and saver.best_model_path == "" and saver.ckpt_path is None
    fit(tmp_path / "snaps", saver, logger=logger(tmp_path / "snaps"))
    assert os.path.relpath(saver.dirpath, tmp_path / "snaps") == os.path.relpath(mc.dirpath, tmp_path / "mc")
    expected = os.path.join("logs", "run", "version_0", "checkpoints") if with_logger else "checkpoints"
    assert os.path.relpath(saver.dirpath, tmp_path / "snaps") == expected
    assert kept(saver.dirpath) == kept(mc.dirpath) == [3, 6]


def test_verbose_logs_one_line_per_snapshot(tmp_path):
    with lightning_log() as lines:
        fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "quiet"), every_n_train_steps=2))
    assert not [line for line in lines if "committed" in line]
    with lightning_log() as lines:
        fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "loud"), every_n_train_steps=2, verbose=True))
    said = [line for line in lines if line.startswith("TorchSnapshotSaver: snapshot ")]
    assert len(said) == 3
    for line, name in zip(said, visible_by_name(tmp_path / "loud"), strict=True):
        assert str(tmp_path / "loud" / name) in line and "committed" in line


@pytest.mark.parametrize("save_last", [None, True, False, "link"])
def test_ckpt_path_last_resumes_the_newest_snapshot_whatever_save_last_says(tmp_path, save_last):
    fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps"), save_last=save_last), max_epochs=1)
    trainer = fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps"), save_last=save_last), ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "snaps" / "epoch_1_step_3")
    assert trainer.global_step == 6
    with pytest.raises(ConfigError, match="save_last must be None, True, False or 'link', got 'always'"):
        TorchSnapshotSaver(str(tmp_path), save_last="always")


# -- resuming: only when asked, or loudly ---------------------------------------------------------


@contextmanager
def all_warnings() -> Iterator[list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        messages: list[str] = []
        yield messages
    messages.extend(str(w.message) for w in seen)


MISLEADING = ("called without a model", "save_last=True")


def test_a_rerun_without_ckpt_path_starts_fresh_as_with_model_checkpoint(tmp_path):
    fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), max_epochs=1)
    with all_warnings() as said:
        trainer = fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), max_epochs=1)
    assert trainer.ckpt_path is None
    assert trainer.global_step == 3  # trained from step 0, not resumed
    assert not [m for m in said if any(text in m for text in MISLEADING)]
    # the earlier run's snapshots are named: the directory holds progress this run does not have
    ahead = [m for m in said if "holds snapshots ahead of this run's progress" in m]
    assert len(ahead) == 1 and "epoch_1_step_3" in ahead[0]


def test_ckpt_path_last_on_a_first_run_says_what_applies_not_lightnings_hint(tmp_path):
    with all_warnings() as said, lightning_log() as lines:
        trainer = fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), ckpt_path="last")
    assert trainer.ckpt_path is None and trainer.global_step == 6
    assert not [m for m in said if any(text in m for text in MISLEADING)]
    ours = [line for line in lines if line.startswith("TorchSnapshotSaver")]
    assert ours == [
        f'TorchSnapshotSaver: ckpt_path="last": no complete snapshot in {tmp_path / "snaps"} yet; '
        "training starts from the beginning."
    ]
    # Lightning's hint is silenced only while the saver resolves "last": it is back afterwards
    with all_warnings() as said:
        make_trainer(tmp_path, [ModelCheckpoint(dirpath=str(tmp_path / "mc"))], max_epochs=1).fit(
            ToyModule(), loader(), ckpt_path="last"
        )
    assert [m for m in said if "save_last=True" in m]

    with lightning_log() as lines:
        trainer = fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), max_epochs=3, ckpt_path="last")
    assert trainer.ckpt_path == str(tmp_path / "snaps" / "epoch_2_step_6")
    assert f'TorchSnapshotSaver: ckpt_path="last": resuming from snapshot {trainer.ckpt_path}' in lines


def test_a_resume_nobody_asked_for_is_announced_in_one_line(tmp_path):
    # Lightning itself turns fit(ckpt_path=None) into "last" when an OnExceptionCheckpoint is
    # among the callbacks; the saver's snapshot is then what it resumes from.
    fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), max_epochs=1)
    on_exception = OnExceptionCheckpoint(str(tmp_path / "exc"))
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"))
    seed_everything(0)
    trainer = make_trainer(tmp_path, [on_exception, saver], max_epochs=2, limit_val_batches=1)
    with all_warnings() as said:
        trainer.fit(ToyModule(), loader(), loader(4))
    snapshot = str(tmp_path / "snaps" / "epoch_1_step_3")
    assert trainer.ckpt_path == snapshot and trainer.global_step == 6
    ours = [m for m in said if m.startswith("TorchSnapshotSaver: resuming")]
    assert len(ours) == 1 and "\n" not in ours[0]
    assert snapshot in ours[0] and "OnExceptionCheckpoint" in ours[0]
    assert "to start fresh, use a new dirpath or remove that callback" in ours[0]


# -- collective_timeout_s -------------------------------------------------------------------------


def test_collective_timeout_s_reaches_every_collective(tmp_path):
    class Timeouts(TorchSnapshotSaver):
        def on_train_start(self, trainer, pl_module):
            super().on_train_start(trainer, pl_module)
            self.io_timeout = trainer.strategy.checkpoint_io.collective_timeout_s

    saver = Timeouts(str(tmp_path / "snaps"), collective_timeout_s=42)
    fit(tmp_path, saver, max_epochs=1)
    assert saver.io_timeout == 42.0  # the CheckpointIO installed for the fit
    assert saver.snapshotter.config.collective_timeout_s == 42.0
    module = ToyModule(seed=3)
    for bad in (0, -1.0, math.inf):
        with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
            TorchSnapshotSaver.restore(str(tmp_path / "snaps" / "epoch_1_step_3"), module, collective_timeout_s=bad)
        with pytest.raises(ConfigError, match="collective_timeout_s must be a positive number"):
            TorchSnapshotSaver.restore_from_latest(str(tmp_path / "snaps"), module, collective_timeout_s=bad)
    TorchSnapshotSaver.restore(str(tmp_path / "snaps" / "epoch_1_step_3"), module, collective_timeout_s=5)
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path / "snaps"), module, collective_timeout_s=5)


def test_train_time_interval_zero_is_refused_a_deliberate_difference(tmp_path):
    ModelCheckpoint(dirpath=str(tmp_path), train_time_interval=datetime.timedelta(0))  # accepted there
    with pytest.raises(ConfigError, match="train_time_interval must be longer than zero"):
        TorchSnapshotSaver(str(tmp_path), train_time_interval=datetime.timedelta(0))


def test_save_on_train_epoch_end_none_follows_model_checkpoints_rule(tmp_path):
    # None with validation twice an epoch: ModelCheckpoint saves after each validation
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc"), save_top_k=-1)
    fit(tmp_path, mc, Logs([0.5]), n=16, val_check_interval=0.5)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), save_top_k=-1)
    fit(tmp_path, saver, Logs([0.5]), n=16, val_check_interval=0.5)
    assert kept(tmp_path / "mc") == kept(tmp_path / "snaps") == [2, 4, 6, 8]
    # True: once, at each epoch's end
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc2"), save_top_k=-1, save_on_train_epoch_end=True)
    fit(tmp_path, mc, Logs([0.5]), n=16, val_check_interval=0.5)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps2"), save_top_k=-1, save_on_train_epoch_end=True)
    fit(tmp_path, saver, Logs([0.5]), n=16, val_check_interval=0.5)
    assert kept(tmp_path / "mc2") == kept(tmp_path / "snaps2") == [4, 8]
    # None with validation every other epoch: only the epochs that validate
    mc = ModelCheckpoint(dirpath=str(tmp_path / "mc3"), save_top_k=-1)
    fit(tmp_path, mc, Logs([0.5]), max_epochs=4, check_val_every_n_epoch=2)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps3"), save_top_k=-1)
    fit(tmp_path, saver, Logs([0.5]), max_epochs=4, check_val_every_n_epoch=2)
    assert kept(tmp_path / "mc3") == kept(tmp_path / "snaps3") == [6, 12]


def test_cadences_combine_a_deliberate_difference(tmp_path):
    with pytest.raises(MisconfigurationException, match="should be mutually exclusive"):
        ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=2, every_n_epochs=1)
    saver = TorchSnapshotSaver(str(tmp_path / "snaps"), every_n_train_steps=2, every_n_epochs=1)
    fit(tmp_path, saver)
    # steps 2, 4, 6 by the step cadence, the epoch ends at steps 3 and 6: at step 6 the epoch
    # end's snapshot is taken after the step's, holding that epoch's validation results
    assert visible_by_name(tmp_path / "snaps") == [
        "epoch_0_step_2", "epoch_1_step_3", "epoch_1_step_4", "epoch_1_step_6", "epoch_2_step_6"
    ]


def test_torchtnt_cadence_names_stay_positive_and_agree_with_model_checkpoints(tmp_path):
    for name in ("save_every_n_epochs", "save_every_n_train_steps"):
        with pytest.raises(ConfigError, match=rf"{name} must be a positive int \(>= 1\) or None, got 0"):
            TorchSnapshotSaver(str(tmp_path), **{name: 0})
    with pytest.raises(ConfigError, match="save_every_n_epochs is another name for every_n_epochs"):
        TorchSnapshotSaver(str(tmp_path), every_n_epochs=0, save_every_n_epochs=2)
    saver = TorchSnapshotSaver(str(tmp_path), every_n_train_steps=2, save_every_n_train_steps=2)
    assert saver.snapshotter.config.save_every_n_train_steps == 2
    assert saver.every_n_epochs is None  # a cadence was given: no default epoch cadence


def test_best_k_models_kth_best_and_last_model_path_read_like_model_checkpoints(tmp_path):
    mc, saver = both(
        tmp_path, lambda: Logs([0.5, 0.3, 0.4, 0.6]), max_epochs=4,
        monitor="val_loss", save_top_k=2, every_n_epochs=1,
    )

    def by_step(models: dict[str, Any]) -> dict[int, float]:
        return {step_of(path): round(float(value), 6) for path, value in models.items()}

    # the newest snapshot (0.6), which the saver also keeps, is not among the best k
    assert by_step(saver.best_k_models) == by_step(mc.best_k_models) == {6: 0.3, 9: 0.4}
    assert list(by_step(saver.best_k_models)) == [6, 9]  # best first
    assert step_of(saver.kth_best_model_path) == step_of(mc.kth_best_model_path) == 9
    # ModelCheckpoint's last_model_path is its last.ckpt (none without save_last); the saver's
    # is the newest snapshot, what ckpt_path="last" resumes
    assert mc.last_model_path == ""
    assert saver.last_model_path == str(tmp_path / "snaps" / "epoch_4_step_12_val_loss=0.6")
    no_monitor = TorchSnapshotSaver(str(tmp_path / "snaps"))
    assert no_monitor.best_k_models == {} and no_monitor.kth_best_model_path == ""


def test_a_dirpath_under_the_home_directory_is_expanded_as_model_checkpoint_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    mc = ModelCheckpoint(dirpath="~/mc")
    saver = TorchSnapshotSaver("~/snaps")
    assert mc.dirpath == str(tmp_path / "mc")
    assert saver.dirpath == str(tmp_path / "snaps")
    fit(tmp_path, saver, max_epochs=1)
    assert visible_by_name(tmp_path / "snaps") == ["epoch_1_step_3"]


def test_to_yaml_writes_best_k_models_like_model_checkpoint(tmp_path):
    import yaml

    mc, saver = both(
        tmp_path, lambda: Logs([0.5, 0.3, 0.4]), max_epochs=3, monitor="val_loss", save_top_k=2
    )
    mc.to_yaml()
    saver.to_yaml()
    theirs = yaml.safe_load((tmp_path / "mc" / "best_k_models.yaml").read_text())
    ours = yaml.safe_load((tmp_path / "snaps" / "best_k_models.yaml").read_text())
    assert {step_of(p): round(v, 6) for p, v in ours.items()} == {step_of(p): round(v, 6) for p, v in theirs.items()}
    assert set(ours) == set(saver.best_k_models)
    # the file beside the snapshots is left alone by a later run in that directory
    fit(tmp_path, TorchSnapshotSaver(str(tmp_path / "snaps")), max_epochs=4,
        ckpt_path=saver.last_model_path)
    assert (tmp_path / "snaps" / "best_k_models.yaml").is_file()
    saver.to_yaml(tmp_path / "elsewhere.yaml")
    assert yaml.safe_load((tmp_path / "elsewhere.yaml").read_text())
