"""State that raw tensor bytes cannot carry, saved and restored exactly by real torchtnt runs:
sparse tensors (COO, CSR, CSC) and nn.Parameter objects (their type and requires_grad) kept in a
stateful's dict. Read back by the plugin and by stock torchsnapshot."""

from __future__ import annotations

import io
import os

import pytest
import torch
import torchsnapshot
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.format.objects import load_object
from toy import Holder, StatefulLoader, ToyUnit, make_data


def sparse_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(6, 5, generator=gen) * (torch.rand(6, 5, generator=gen) > 0.6)
    uncoalesced = torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 2], [1, 1, 3]]), torch.tensor([1.0, 2.0, 3.0]), (4, 4), check_invariants=True
    )
    return {
        "coo": dense.to_sparse(),
        "coo_uncoalesced": uncoalesced,
        "csr": dense.to_sparse_csr(),
        "csc": dense.to_sparse_csc(),
        "int_coo": (dense * 10).to(torch.int64).to_sparse(),
    }


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def same_sparse(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != b.layout or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout == torch.sparse_coo:
        return a.is_coalesced() == b.is_coalesced() and torch.equal(a._indices(), b._indices()) and torch.equal(
            a._values(), b._values()
        )
    if a.layout == torch.sparse_csr:
        parts = (torch.Tensor.crow_indices, torch.Tensor.col_indices, torch.Tensor.values)
    else:
        parts = (torch.Tensor.ccol_indices, torch.Tensor.row_indices, torch.Tensor.values)
    return all(torch.equal(part(a), part(b)) for part in parts)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSC tensor support is in beta:UserWarning")
@pytest.mark.parametrize("async_checkpoint", [True, False], ids=["async", "sync"])
def test_sparse_tensors_save_and_restore_exactly(tmp_path, async_checkpoint):
    unit = ToyUnit()
    state = sparse_state()
    unit.sparse = Holder(state)
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, async_checkpoint=async_checkpoint)
    train(unit, StatefulLoader(make_data(24)), max_epochs=1, callbacks=[saver])
    snapshots = [n for n in os.listdir(tmp_path) if n.startswith("epoch_")]
    assert "epoch_0_step_2" in snapshots and len(snapshots) >= 3

    fresh = ToyUnit(seed=9)
    fresh.sparse = Holder({})
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    assert sorted(fresh.sparse.state) == sorted(state)
    for key, value in state.items():
        assert same_sparse(fresh.sparse.state[key], value), key

    # A sparse tensor whose indices lie outside its shape (damaged bytes, resealed) is refused
    # as it is loaded, never handed over to read out of bounds.
    bad = torch.sparse_coo_tensor(torch.tensor([[0, 9]]), torch.tensor([1.0, 2.0]), (4,), check_invariants=False)
    with pytest.raises(RuntimeError, match="index"):
        load_object(_saved(bad))

    # Stock torchsnapshot reads the same entries.
    snapshot = torchsnapshot.Snapshot(str(tmp_path / "epoch_0_step_2"))
    assert same_sparse(snapshot.read_object("0/sparse/csr"), state["csr"])
    assert same_sparse(snapshot.read_object("0/sparse/coo_uncoalesced"), state["coo_uncoalesced"])


@pytest.mark.parametrize("async_checkpoint", [True, False], ids=["async", "sync"])
def test_parameters_in_a_stateful_dict_come_back_as_parameters_with_their_requires_grad(tmp_path, async_checkpoint):
    unit = ToyUnit()
    trained = torch.nn.Parameter(torch.randn(3))
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)
    unit.extra = Holder({"trained": trained, "frozen": frozen, "plain": torch.arange(4.0)})
    saver = TorchSnapshotSaver(str(tmp_path), save_every_n_train_steps=2, async_checkpoint=async_checkpoint)
    train(unit, StatefulLoader(make_data(4)), max_epochs=1, callbacks=[saver])

    # Into an empty dict: the saved Parameters themselves.
    fresh = ToyUnit(seed=9)
    fresh.extra = Holder({})
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), fresh)
    got = fresh.extra.state
    assert type(got["trained"]) is torch.nn.Parameter and got["trained"].requires_grad
    assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad
    assert type(got["plain"]) is torch.Tensor
    assert torch.equal(got["trained"].detach(), trained.detach()) and torch.equal(got["frozen"].detach(), frozen.detach())

    # Into Parameters already there (an optimizer may hold them): filled in place, the saved
    # requires_grad set on them.
    target_trained = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    target_frozen = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([target_trained, target_frozen], lr=0.1)
    again = ToyUnit(seed=9)
    again.extra = Holder({"trained": target_trained, "frozen": target_frozen, "plain": torch.zeros(4)})
    assert TorchSnapshotSaver.restore_from_latest(str(tmp_path), again)
    assert again.extra.state["trained"] is target_trained and again.extra.state["frozen"] is target_frozen
    assert optimizer.param_groups[0]["params"][0] is target_trained
    assert target_trained.requires_grad and not target_frozen.requires_grad
    assert torch.equal(target_trained.detach(), trained.detach())
    assert torch.equal(target_frozen.detach(), frozen.detach())

    # Stock torchsnapshot reads a Parameter back as one.
    name = sorted(n for n in os.listdir(tmp_path) if n.startswith("epoch_"))[-1]
    read = torchsnapshot.Snapshot(str(tmp_path / name)).read_object("0/extra/trained")
    assert type(read) is torch.nn.Parameter and read.requires_grad
