"""Synthetic data and a resumable shuffling loader, used by the demo command and the tests.

Pure torch: no framework imports.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def make_data(n: int = 40, seed: int = 0, features: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A small regression problem: y = sum(x) + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


class ResumableLoader:
    """A shuffling batch loader that resumes mid-epoch through ``state_dict``/``load_state_dict``.

    Each epoch's order comes from a generator seeded with ``seed + epoch``; the state is
    (epoch, batches served in that epoch). After ``load_state_dict`` the next ``iter()`` continues
    where the saved loader stopped.
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
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.position < len(self):
            idx = order[self.position * self.batch_size : (self.position + 1) * self.batch_size]
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
