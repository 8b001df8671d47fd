"""The application state a snapshot holds: reserved entries, RNG, collisions, replicated entries.

A snapshot holds the framework's state (given by an adapter as ``key -> Stateful``) plus the
plugin's own entries:

* ``rng_state``: torch's CPU generator, Python's ``random``, numpy's global generator (when numpy
  imports) and every initialised CUDA device's generator, so resume is bitwise;
* ``train_dataloader``: the train loader's own state in mid-epoch snapshots, when the loader has
  ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Mapping, Optional

import torch

from tnt_snapshot_plugin.errors import KeyCollisionError, StateMismatchError

RNG_STATE_KEY = "rng_state"
TRAIN_DATALOADER_KEY = "train_dataloader"
RESERVED_KEYS = (RNG_STATE_KEY, TRAIN_DATALOADER_KEY)

#: Entries that differ between ranks by nature and are therefore never marked replicated.
NEVER_REPLICATED_SUFFIX = "_progress"


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_collisions(
    unit_keys: Iterable[str],
    extra: Iterable[tuple[str, Iterable[str]]] = (),
) -> None:
    """Raise KeyCollisionError naming the key if the unit uses a reserved key or two sources clash.

    ``extra`` lists (source, keys) pairs, e.g. each plugin's extra-state keys.
    """
    owner: dict[str, str] = {key: "tnt_snapshot_plugin (reserved)" for key in RESERVED_KEYS}
    for key in unit_keys:
        if key in owner:
            raise KeyCollisionError(
                f"Detected collision for key in app state: {key!r} is reserved by "
                f"tnt_snapshot_plugin for its own entries {RESERVED_KEYS}; rename that attribute "
                "of your unit"
            )
        owner[key] = "the unit"
    for source, keys in extra:
        for key in keys:
            if key in owner:
                raise KeyCollisionError(
                    f"Detected collision for key in app state: {key!r} from {source} is already "
                    f"used by {owner[key]}; give one of them another key"
                )
            owner[key] = source


# ------------------------------------------------------------------------------------------------
# RNG


def _numpy() -> Optional[Any]:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


class RNGState:
    """A Stateful over every RNG a training step draws from.

    ``state_dict()`` captures the generators now; ``load_state_dict()`` sets them. Everything is
    stored as tensors and plain numbers, so loading unpickles nothing.

    The torch CPU state sits under ``"rng_state"``, where torchsnapshot's own ``RNGState`` (and so
    torchtnt's saver) keeps it: torchtnt can restore a snapshot this plugin wrote, and this class
    restores the torch state of one torchtnt wrote (whose other generators were never saved).
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "rng_state": torch.get_rng_state(),
            "python": {
                "version": version,
                "state": torch.tensor(internal, dtype=torch.int64),
                "has_gauss": gauss is not None,
                "gauss": float(gauss) if gauss is not None else 0.0,
            },
        }
        np = _numpy()
        if np is not None:
            algo, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "algorithm": str(algo),
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["rng_state"].to(torch.uint8))
        py = state.get("python")
        if py is not None:
            random.setstate(
                (
                    int(py["version"]),
                    tuple(int(x) for x in py["state"].tolist()),
                    float(py["gauss"]) if py["has_gauss"] else None,
                )
            )
        np = _numpy()
        if np is not None and "numpy" in state:
            nps = state["numpy"]
            np.random.set_state(
                (
                    nps["algorithm"],
                    nps["keys"].numpy().astype(np.uint32),
                    int(nps["pos"]),
                    int(nps["has_gauss"]),
                    float(nps["cached_gaussian"]),
                )
            )
        if "cuda" in state and torch.cuda.is_available():
            cuda_states = [s.to(torch.uint8).cpu() for s in state["cuda"]]
            if len(cuda_states) != torch.cuda.device_count():
                raise StateMismatchError(
                    f"the snapshot holds RNG states for {len(cuda_states)} CUDA devices, this "
                    f"process sees {torch.cuda.device_count()}; restore with the same number of "
                    "visible devices (CUDA_VISIBLE_DEVICES)"
                )
            torch.cuda.set_rng_state_all(cuda_states)


# ------------------------------------------------------------------------------------------------
# Frozen state: what the background writer sees


class Frozen:
    """A read-only Stateful holding an already captured state dict."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state: Any) -> None:
        raise TypeError("a frozen snapshot entry cannot be loaded into")


class Value:
    """A Stateful holding a plain value: one part of a framework's own state dict.

    ``state_dict()`` returns the value as it is; ``load_state_dict()`` replaces it. Adapters save
    framework state that is not an object with ``state_dict()`` (a dict, a list, a number) through
    it, and read a snapshot's entries back into fresh instances.
    """

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, state: Any) -> None:
        self.value = state
