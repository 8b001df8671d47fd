"""Small real training setups shared by the tests: a torchtnt unit and a stateful loader."""

from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch
from torchtnt.framework.state import State
from torchtnt.framework.unit import EvalUnit, TrainUnit

from tnt_snapshot_plugin.demo_data import Batch, ResumableLoader, make_data  # noqa: F401  (re-exported)

# The tests' name for the package's resumable loader.
StatefulLoader = ResumableLoader


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
        # Python's and numpy's RNGs scale the loss (and so the gradients): their state must
        # resume exactly for the weights to match.
        scale = 1.0 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.mse_loss(self.model(x), y) * scale
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


class Holder:
    """A Stateful returning whatever state dict the test sets."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state
