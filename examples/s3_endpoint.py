"""Snapshots in S3, or in any S3-compatible store (MinIO, Ceph, moto), through an endpoint URL.

The script trains with snapshots into an ``s3://`` directory, then restores the latest one into a
fresh unit and checks that it holds the trained weights. To try it on one machine, against
moto's S3 server (``pip install "moto[server]"``):

    moto_server -H 127.0.0.1 -p 5000 &
    AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing \\
        python examples/s3_endpoint.py --endpoint-url http://127.0.0.1:5000 --create-bucket

Credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (unset: boto3's usual
chain, ``~/.aws`` included). Needs ``pip install "tnt-snapshot-plugin[torchtnt,s3]"``.
"""

import argparse
import os
import sys
import uuid

import boto3
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchtnt.framework.state import State
from torchtnt.framework.train import train
from torchtnt.framework.unit import TrainUnit

# --8<-- [start:imports]
from tnt_snapshot_plugin import latest_snapshot
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver

# --8<-- [end:imports]

Batch = tuple[torch.Tensor, torch.Tensor]


class Regressor(TrainUnit[Batch]):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def train_step(self, state: State, data: Batch) -> None:
        x, y = data
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


def make_dataloader() -> DataLoader:
    """100 shuffled batches an epoch."""
    x = torch.randn(800, 4, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8, shuffle=True)


def create_bucket(dirpath: str, endpoint_url: str) -> None:
    """Create the bucket of ``dirpath`` unless it exists (credentials as below)."""
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name="us-east-1")
    try:
        client.create_bucket(Bucket=dirpath[len("s3://"):].split("/")[0])
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Snapshots in an S3-compatible store.")
    parser.add_argument("--endpoint-url", required=True, help="the S3 service, e.g. http://127.0.0.1:5000")
    parser.add_argument("--dirpath", help="s3://BUCKET/PREFIX for the snapshots (default: a new prefix in s3://snapshots)")
    parser.add_argument("--create-bucket", action="store_true", help="create the bucket first (a fresh server has none)")
    args = parser.parse_args(argv)
    dirpath = args.dirpath or f"s3://snapshots/example-{uuid.uuid4().hex[:8]}"

    if args.create_bucket:
        create_bucket(dirpath, args.endpoint_url)

    torch.manual_seed(0)
    unit = Regressor()
    # --8<-- [start:s3]
    storage_options = {
        "endpoint_url": args.endpoint_url,
        "region_name": "us-east-1",
        "aws_access_key_id": os.environ.get("AWS_ACCESS_KEY_ID"),  # None: boto3's usual chain
        "aws_secret_access_key": os.environ.get("AWS_SECRET_ACCESS_KEY"),
    }
    saver = TorchSnapshotSaver(dirpath, save_every_n_epochs=1, storage_options=storage_options)
    train(unit, make_dataloader(), max_epochs=2, callbacks=[saver])

    fresh = Regressor()
    TorchSnapshotSaver.restore_from_latest(dirpath, fresh, storage_options=storage_options)
    # --8<-- [end:s3]
    print(f"latest snapshot: {latest_snapshot(dirpath, storage_options=storage_options)}")
    same = all(
        torch.equal(a, b)
        for a, b in zip(fresh.model.state_dict().values(), unit.model.state_dict().values(), strict=True)
    )
    print(f"restored at step {fresh.train_progress.num_steps_completed}; weights equal the trained ones: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
