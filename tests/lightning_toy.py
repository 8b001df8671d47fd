"""Small real Lightning setups shared by the Lightning tests, and the script their subprocesses run.

As a module: ``ToyModule`` (dropout, Adam, an epoch-interval StepLR, Python and numpy randomness
in the step), ``ResumableLoader`` (a sized loader Lightning resumes mid-epoch), ``make_trainer``.

As a script (``python tests/lightning_toy.py MODE OUTDIR``), for the tests that need processes of
their own: ``preempt`` (a run that sends itself SIGTERM), and ``ddp`` / ``ddp-preempt`` (one rank of
a 2-process gloo DDP run; the test starts both ranks with LOCAL_RANK/WORLD_SIZE/MASTER_* set, as
torchrun would). Each writes ``OUTDIR/result_rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Iterator, Optional

import numpy as np
import pytorch_lightning as pl
import torch
from dir_listing import visible_by_name
from torch.utils.data import DataLoader, TensorDataset

from tnt_snapshot_plugin.demo_data import make_data

Batch = tuple[torch.Tensor, torch.Tensor]


class ToyModule(pl.LightningModule):
    """A regression module whose step draws from every RNG: dropout (torch), random, numpy."""

    def __init__(
        self,
        seed: int = 0,
        fail_at_step: Optional[int] = None,
        preempt_at_step: Optional[int] = None,
        step_s: float = 0.0,
    ) -> None:
        """``step_s``: each training step sleeps this long first."""
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.fail_at_step = fail_at_step
        self.preempt_at_step = preempt_at_step
        self.step_s = step_s

    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        if self.fail_at_step is not None and step == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {step}")
        if self.preempt_at_step is not None and step == self.preempt_at_step:
            os.kill(os.getpid(), signal.SIGTERM)  # the saver's handler only sets a flag
        if self.step_s:
            time.sleep(self.step_s)
        x, y = batch
        noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        return torch.nn.functional.mse_loss(self.net(x), y) + noise

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class EpochSampler(torch.utils.data.Sampler[int]):
    """This rank's share of a permutation drawn from ``seed + epoch``; Lightning calls
    ``set_epoch(epoch)`` at each epoch start, as for a DistributedSampler."""

    def __init__(self, n: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.n, self.seed, self.rank, self.world_size = n, seed, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(range(self.rank, self.n, self.world_size))

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[self.rank :: self.world_size].tolist())


class ResumableLoader(DataLoader):
    """A DataLoader that Lightning 2.6 resumes mid-epoch, as torchdata's StatefulDataLoader does.

    What that takes: ``state_dict()``/``load_state_dict()`` (Lightning's ``_Stateful`` protocol:
    Lightning saves the state in its loop state, and loads it before ``iter()`` when restarting
    mid-epoch), and a length (else Lightning fetches a batch ahead and the saved position is one
    batch past the step). Creating the iterator draws the base seed from torch's global RNG, as
    every DataLoader does; the order comes from :class:`EpochSampler`. Resuming skips the batches
    already served in the epoch.
    """

    def __init__(
        self,
        data: tuple[torch.Tensor, torch.Tensor],
        batch_size: int = 4,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        x, y = data
        super().__init__(
            TensorDataset(x, y), batch_size=batch_size, sampler=EpochSampler(len(x), seed, rank, world_size)
        )
        self.position = 0
        self._start = 0

    def __iter__(self) -> Iterator[Batch]:  # type: ignore[override]
        batches = super().__iter__()  # draws the base seed now
        start, self._start = self._start, 0
        return self._counted(batches, start)

    def _counted(self, batches: Iterator[Batch], start: int) -> Iterator[Batch]:
        self.position = 0
        for batch in batches:
            self.position += 1
            if self.position > start:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.sampler.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.epoch = int(state["epoch"])
        # A state saved after the epoch's last batch resumes at the next epoch's start.
        self._start = self.position = int(state["position"]) % len(self)


def plain_loader(n: int = 20, batch_size: int = 4, seed: int = 0) -> DataLoader:
    """A shuffling DataLoader (its order comes from the global torch RNG; not resumable mid-epoch)."""
    x, y = make_data(n, seed=seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)


def make_trainer(root: Any, callbacks: list[Any], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=str(root),
    )
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def optimizer_tensors(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizers[0].state_dict()["state"]
    return {f"{i}.{k}": v.clone() for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Tensors as exact lists (float32 -> float64 is exact), for JSON."""
    return {k: v.double().flatten().tolist() for k, v in tensors.items()}


# ------------------------------------------------------------------------------------------------
# Launching the script (from the tests)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_script(mode: str, out: Any, *, ranks: int = 1, timeout: float = 300.0) -> list[int]:
    """Run this file as ``ranks`` processes (env as torchrun sets it, loopback only); their exit
    statuses. Each process writes ``out/log{rank}.txt``."""
    port = str(_free_port())
    procs = []
    for rank in range(ranks):
        env = dict(os.environ)
        if ranks > 1:
            env.update(
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
        log = open(os.path.join(out, f"log{rank}.txt"), "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, __file__, mode, str(out)], env=env, stdout=log, stderr=subprocess.STDOUT
                ),
                log,
            )
        )
    codes = []
    try:
        for proc, log in procs:
            codes.append(proc.wait(timeout=timeout))
            log.close()
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return codes


def logs(out: Any) -> str:
    """The processes' output, for assertion messages."""
    texts = []
    for name in sorted(os.listdir(out)):
        if name.startswith("log"):
            with open(os.path.join(out, name)) as f:
                texts.append(f"--- {name}\n" + f.read()[-3000:])
    return "\n".join(texts)


# ------------------------------------------------------------------------------------------------
# The script side


def _preempt(out: str) -> None:
    """One process: snapshot every 2 steps, SIGTERM at step 3 (during the 4th batch)."""
    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    seed_everything(7)
    module = ToyModule(seed=0, preempt_at_step=3)
    saver = TorchSnapshotSaver(os.path.join(out, "snaps"), save_every_n_train_steps=2)
    trainer = make_trainer(out, [saver], max_epochs=2)
    with open(os.path.join(out, "result_rank0.json"), "w") as f:
        json.dump({"started": True}, f)
    trainer.fit(module, ResumableLoader(make_data(40), seed=3))
    raise AssertionError("fit returned after SIGTERM")  # not reached: SIGTERMException exits


def _ddp(out: str, preempt: bool) -> None:
    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    rank = int(os.environ["LOCAL_RANK"])
    result: dict[str, Any] = {"rank": rank}
    snaps = os.path.join(out, "snaps")

    def trainer(callbacks: list[Any]) -> pl.Trainer:
        return make_trainer(
            out, callbacks, strategy="ddp", devices=2, max_epochs=2, use_distributed_sampler=False
        )

    def loader() -> ResumableLoader:
        return ResumableLoader(make_data(40), seed=3, rank=rank, world_size=2)

    if preempt:
        seed_everything(7 + rank)
        saver = TorchSnapshotSaver(snaps, save_every_n_train_steps=2)
        with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "started": True}, f)
        # Only rank 0 receives the signal; the ranks agree on the step to stop at. Steps of 0.3 s
        # (over distributed.AGREE_EVERY_S): the ranks agree at every step, the answer one step later.
        module = ToyModule(seed=0, preempt_at_step=3 if rank == 0 else None, step_s=0.3)
        trainer([saver]).fit(module, loader())
        raise AssertionError("fit returned after SIGTERM")

    # 1. the reference: uninterrupted, no saver
    seed_everything(7 + rank)
    reference = ToyModule(seed=0)
    trainer([]).fit(reference, loader())

    # 2. interrupted mid-epoch 2; rank 1 names another dirpath, rank 0's wins
    seed_everything(7 + rank)
    mine = snaps if rank == 0 else os.path.join(out, "rank1_dirpath")
    saver = TorchSnapshotSaver(mine, save_every_n_train_steps=3, save_every_n_epochs=1)
    try:
        trainer([saver]).fit(ToyModule(seed=0, fail_at_step=8), loader())
    except RuntimeError as exc:
        result["interrupted"] = str(exc)
    result["saver_dirpath"] = saver.dirpath

    # 3. a fresh Trainer and module with other seeds resume from the latest snapshot
    seed_everything(1000 + rank)
    resumed = ToyModule(seed=42 + rank)
    fresh = trainer([TorchSnapshotSaver(snaps, save_every_n_train_steps=3, save_every_n_epochs=1)])
    fresh.fit(resumed, loader(), ckpt_path="last")
    result.update(
        resumed_from=str(fresh.ckpt_path),
        global_step=fresh.global_step,
        current_epoch=fresh.current_epoch,
        reference=digest(weights(reference)),
        resumed=digest(weights(resumed)),
    )
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)


class ScoredByEpoch(ToyModule):
    """Logs ``val_loss`` from :data:`BEST_VAL_LOSS` by epoch (the same on every rank)."""

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log("val_loss", BEST_VAL_LOSS[self.trainer.current_epoch])


#: the val_loss of each epoch in ``ddp-best``
BEST_VAL_LOSS = [0.5, 0.3, 0.4, 0.6, 0.45]


def _ddp_best(out: str) -> None:
    """One rank of a DDP run with best-k (beside a ModelCheckpoint with the same arguments), then
    a new Trainer resuming with ``ckpt_path="best"``."""
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint

    from tnt_snapshot_plugin.adapters.lightning import TorchSnapshotSaver

    rank = int(os.environ["LOCAL_RANK"])
    snaps = os.path.join(out, "snaps")

    def loader(n: int) -> ResumableLoader:
        return ResumableLoader(make_data(n), seed=3, rank=rank, world_size=2)

    def trainer(callbacks: list[Any], max_epochs: int) -> pl.Trainer:
        return make_trainer(
            out, callbacks, strategy="ddp", devices=2, max_epochs=max_epochs,
            use_distributed_sampler=False, limit_val_batches=1, num_sanity_val_steps=0,
        )

    arguments = dict(monitor="val_loss", mode="min", save_top_k=1, every_n_epochs=1)
    seed_everything(7)
    mc = ModelCheckpoint(dirpath=os.path.join(out, "mc"), **arguments)
    mine = snaps if rank == 0 else os.path.join(out, "rank1_dirpath")  # rank 0's wins
    saver = TorchSnapshotSaver(mine, collective_timeout_s=60, **arguments)
    trainer([mc, saver], max_epochs=4).fit(ScoredByEpoch(seed=0), loader(24), loader(8))
    result: dict[str, Any] = {
        "rank": rank,
        "best_model_path": saver.best_model_path,
        "best_model_score": float(saver.best_model_score),
        "mc_best_model_path": mc.best_model_path,
        "mc_best_model_score": float(mc.best_model_score),
        "kept": visible_by_name(snaps),
        "mc_kept": visible_by_name(os.path.join(out, "mc")),
    }

    class Start(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            result["resumed_at"] = [trainer.current_epoch, trainer.global_step]

    resumer = TorchSnapshotSaver(snaps, collective_timeout_s=60, **arguments)
    again = trainer([resumer, Start()], max_epochs=5)
    again.fit(ScoredByEpoch(seed=1 + rank), loader(24), loader(8), ckpt_path="best")
    result.update(
        resumed_from=str(again.ckpt_path),
        global_step=again.global_step,
        best_after_resume=resumer.best_model_path,
        kept_after_resume=visible_by_name(snaps),
    )
    # no dirpath: every rank resolves ModelCheckpoint's default, rank 0's is used
    default = TorchSnapshotSaver(collective_timeout_s=60)
    trainer([default], max_epochs=1).fit(ScoredByEpoch(seed=0), loader(24), loader(8))
    result.update(default_dirpath=default.dirpath, default_kept=visible_by_name(default.dirpath))
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main(argv: list[str]) -> None:
    mode, out = argv
    torch.set_num_threads(1)
    if mode == "preempt":
        _preempt(out)
    elif mode in ("ddp", "ddp-preempt"):
        _ddp(out, preempt=mode == "ddp-preempt")
    elif mode == "ddp-best":
        _ddp_best(out)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
