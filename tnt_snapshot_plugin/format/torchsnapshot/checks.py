"""What restore checks before it reads anything: that the modules to load have the snapshot's
tensors, of the snapshot's shapes."""

from __future__ import annotations

from typing import Any, Mapping

from tnt_snapshot_plugin.errors import StateMismatchError
from tnt_snapshot_plugin.format.torchsnapshot.manifest import global_shape


def check_modules(path: str, load: Mapping[str, Any], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Raise StateMismatchError unless every module of ``load`` has the snapshot's tensors, of
    the snapshot's shapes; the modules' state dicts (read into next, not asked for twice)."""
    import torch

    problems: list[str] = []
    currents: dict[str, Any] = {}
    for key, obj in load.items():
        if not isinstance(obj, torch.nn.Module):
            continue
        current = currents[key] = obj.state_dict()
        expected = {name: t for name, t in current.items() if isinstance(t, torch.Tensor)}
        prefix = key + "/"
        cut = len(prefix)
        saved: dict[str, tuple[int, ...]] = {}
        for entry_path, entry in manifest.items():
            if entry_path.startswith(prefix) and (shape := global_shape(entry)) is not None:
                saved[entry_path[cut:]] = tuple(shape)
        if expected.keys() != saved.keys():  # (sorted only to say what differs)
            missing = sorted(set(expected) - set(saved))
            unexpected = sorted(set(saved) - set(expected))
            if missing:
                problems.append(f"{key}: the module has {missing} that the snapshot lacks")
            if unexpected:
                problems.append(f"{key}: the snapshot has {unexpected} that the module lacks")
        # torch.Size is a tuple: compared with the saved shape as is, one tensor at a time
        for name in sorted(n for n, t in expected.items() if n in saved and t.shape != saved[n]):
            problems.append(
                f"{key}.{name}: shape {list(expected[name].shape)} in the module, "
                f"{list(saved[name])} in the snapshot"
            )
    if problems:
        raise StateMismatchError(
            f"cannot restore {path}: the modules do not match the snapshot: " + "; ".join(problems)
        )
    return currents
