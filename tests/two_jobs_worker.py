"""A real training job for tests/test_no_silent_loss.py: ``python two_jobs_worker.py MODE DIRPATH READY``.

* ``plain``: trains ToyUnit for 4 steps, a snapshot every step, into DIRPATH.
* ``hang``: the same, but the write of step 3's first data file blocks forever (after the writer
  marker went in), having written the pid to READY: a live job in the middle of a write, which
  the test then SIGKILLs.
"""

from __future__ import annotations

import os
import sys
import time

from torchtnt.framework.train import train

from tnt_snapshot_plugin import storage
from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from toy import StatefulLoader, ToyUnit, make_data


def main() -> None:
    mode, dirpath, ready = sys.argv[1:4]
    if mode == "hang":
        real = storage._write_durably

        def write(path: str, data: object) -> None:
            if "epoch_0_step_3" in path and not path.endswith(storage.WRITER_FNAME):
                with open(ready + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(ready + ".tmp", ready)
                time.sleep(3600)
            real(path, data)

        storage._write_durably = write
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, preemption_signals=[])
    train(ToyUnit(), StatefulLoader(make_data(4 * 4)), max_epochs=1, callbacks=[saver])
    print("trained", flush=True)


if __name__ == "__main__":
    main()
