"""Small real training setups shared by the tests: a torchtnt unit and a stateful loader."""

from __future__ import annotations

import random
from typing import Any, Iterator, Optional

import numpy as np
import torch
from torchtnt.framework.state import State
from torchtnt.framework.unit import EvalUnit, TrainUnit

Batch = tuple[torch.Tensor, torch.Tensor]


def make_data(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


class StatefulLoader:
    """A shuffling loader that can resume mid-epoch (``state_dict``/``load_state_dict``).

    Each epoch draws a permutation from its own generator; the state is (epoch, batches served).
    """

    def __init__(self, data: tuple[torch.Tensor, torch.Tensor], batch_size: int = 4, seed: int = 0):
        self.x, self.y = data
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._resuming = False

    def __len__(self) -> int:
        return (len(self.x) + self.batch_size - 1) // self.batch_size

    def __iter__(self) -> Iterator[Batch]:
        if not self._resuming:
            self.position = 0
        self._resuming = False
        perm = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self):
            idx = perm[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            yield self.x[idx], self.y[idx]
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._resuming = self.position > 0


class ToyUnit(TrainUnit[Batch], EvalUnit[Batch]):
    """A regression unit whose step draws from every RNG: dropout (torch), random, numpy."""

    def __init__(self, seed: int = 0, fail_at_step: Optional[int] = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.lr_scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.fail_at_step = fail_at_step

    def train_step(self, state: State, data: Batch) -> None:
        if self.fail_at_step is not None and self.train_progress.num_steps_completed == self.fail_at_step:
            raise RuntimeError(f"injected failure at step {self.fail_at_step}")
        x, y = data
        # Python's and numpy's RNGs feed the step too, so their state must resume exactly.
        noise = random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.mse_loss(self.model(x), y) + noise
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def on_train_epoch_end(self, state: State) -> None:
        self.lr_scheduler.step()

    def eval_step(self, state: State, data: Batch) -> None:
        with torch.no_grad():
            self.model(data[0])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def weights(unit: ToyUnit) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in unit.model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"
