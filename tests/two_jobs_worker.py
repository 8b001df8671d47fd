"""A real training job for tests/test_no_silent_loss.py: ``python two_jobs_worker.py MODE DIRPATH READY``.

* ``plain``: trains ToyUnit for 4 steps, a snapshot every step, into DIRPATH.
* ``hang``: the same, but the write of step 3's first data file blocks forever (after the writer
  marker went in), having written the pid to READY: a live job in the middle of a write, which
  the test then SIGKILLs. The block is a FaultyStore hook around the real local store of DIRPATH,
  registered in this process as ``fake://hang``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.stores import LocalStore
from tnt_snapshot_plugin.testing import FaultyStore, register
from toy import StatefulLoader, ToyUnit, make_data


def main() -> None:
    mode, dirpath, ready = sys.argv[1:4]
    if mode == "hang":

        announced = threading.Lock()

        def hang(staging: str, rel: str) -> None:
            # Several I/O threads may get here at once: the first one announces it.
            if announced.acquire(blocking=False):
                with open(ready + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(ready + ".tmp", ready)
            time.sleep(3600)

        faulty = FaultyStore(LocalStore(dirpath))
        faulty.hook("write_payload", before=hang, match=lambda staging, rel: "epoch_0_step_3" in staging)
        dirpath = register("hang", faulty)
    saver = TorchSnapshotSaver(dirpath, save_every_n_train_steps=1, preemption_signals=[])
    train(ToyUnit(), StatefulLoader(make_data(4 * 4)), max_epochs=1, callbacks=[saver])
    print("trained", flush=True)


if __name__ == "__main__":
    main()
