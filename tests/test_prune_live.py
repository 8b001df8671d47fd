"""`tnt-snapshot prune` while a live torchtnt run (another process) holds the dirpath: refused with
exit status 2 naming the holder, every time; --force prunes anyway; once the run has ended, prune
runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from click.testing import CliRunner
from dir_listing import snapshots_by_step

from tnt_snapshot_plugin.cli import cli

RUN = textwrap.dedent(
    """
    import sys, time, warnings
    sys.path.insert(0, {tests!r})
    warnings.simplefilter("ignore")
    from torchtnt.framework.train import train
    from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
    from toy import StatefulLoader, ToyUnit, make_data

    class Slow(ToyUnit):
        def train_step(self, state, data):
            super().train_step(state, data)
            time.sleep(0.2 if self.train_progress.num_steps_completed < 4 else 60)

    saver = TorchSnapshotSaver({dirpath!r}, save_every_n_train_steps=1, async_checkpoint=False)
    train(Slow(), StatefulLoader(make_data(400)), max_epochs=1, callbacks=[saver])
    """
)


def test_prune_refuses_while_a_live_run_holds_the_dirpath(tmp_path):
    dirpath = tmp_path / "run"
    script = RUN.format(tests=str(Path(__file__).parent), dirpath=str(dirpath))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while len(snapshots_by_step(dirpath) if dirpath.exists() else []) < 4:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the run wrote no snapshots"
            time.sleep(0.2)
        before = snapshots_by_step(dirpath)
        for _ in range(4):  # every time, not most times
            result = CliRunner().invoke(cli, ["prune", str(dirpath), "--keep-last", "1"])
            assert result.exit_code == 2, result.output
            assert f"pid {proc.pid}" in result.stderr and "--force" in result.stderr
            assert result.stderr.count("\n") == 1
            assert snapshots_by_step(dirpath) == before
        # a dry run deletes nothing, so it needs no lock
        assert CliRunner().invoke(cli, ["prune", str(dirpath), "--keep-last", "1", "--dry-run"]).exit_code == 0
        result = CliRunner().invoke(cli, ["prune", str(dirpath), "--keep-last", "1", "--force", "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["deleted"] == before[:-1]
        assert snapshots_by_step(dirpath) == before[-1:]
    finally:
        proc.kill()
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()
    # The run has ended: its lock went with it.
    result = CliRunner().invoke(cli, ["prune", str(dirpath), "--keep-last", "1"])
    assert result.exit_code == 0, result.output
