"""A state holding every kind of entry the format stores, and bitwise comparison of states."""

from __future__ import annotations

import torch


def varied_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype)

    return {
        "dtypes": {
            str(dt): rand(5, 3, dtype=dt)
            for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                       torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
        },
        "scalar": rand(()),  # 0-d
        "empty": rand(0, 4),
        "big": rand(700_000),  # over torchsnapshot's slab threshold: a file of its own
        "small": [rand(64) for _ in range(50)],  # packed together into one file
        "complex": torch.randn(4, generator=g, dtype=torch.complex64),  # stored with torch.save
        "transposed": rand(4, 6).t(),  # a non-contiguous target: torchsnapshot's path
        "objects": {"step": 7, "name": "run", "set": {1, 2}},
    }


def zeros_like_state(state: dict) -> dict:
    def zero(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)  # keeps the layout, so "transposed" stays non-contiguous
        if isinstance(v, dict):
            return {k: zero(x) for k, x in v.items()}
        if isinstance(v, list):
            return [zero(x) for x in v]
        return None

    return zero(state)


def assert_identical(got, want):
    """Equal types, dtypes, shapes and bytes (NaNs included), recursively."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8))
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_identical(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_identical(a, b)
    else:
        assert got == want
