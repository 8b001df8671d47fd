"""After the plugin has taken and restored snapshots, torchsnapshot and the process are as if the
plugin had never been imported (issue 11, "No process-wide patches").

Two fresh interpreters (tests/no_patches_worker.py) run the same seeded torchtnt training: one
with the plugin's saver (a synchronous run with ``knob_options``, then an asynchronous run) and
two restores, one without the plugin. Compared: every attribute of every torchsnapshot module and
of the classes they define (identity for functions, classes and descriptors, equality for other
values), ``os.environ`` (after the run, and while the plugin serializes an object entry during a
write), the gc settings, the signal handlers, torch's safe-globals list, torchsnapshot's loggers,
and the Python, numpy and torch CPU RNG states. A change the run without the plugin shows too
(torch's own) is not the plugin's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "no_patches_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no_patches")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, WORKER, mode, str(tmp / f"{mode}.json"), str(tmp / "snapshots")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for mode in ("plugin", "baseline")
    }
    results = {}
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"the {mode} run failed:\n{output[-5000:]}"
        results[mode] = json.loads((tmp / f"{mode}.json").read_text())
    assert results["plugin"]["plugin imported"] and not results["baseline"]["plugin imported"]
    assert len(results["plugin"]["snapshots"]) >= 4, results["plugin"]["snapshots"]
    return results


def test_torchsnapshot_attributes_environment_gc_and_signals_are_left_as_they_were(runs):
    torch_own = set(runs["baseline"]["differences"])
    changed = [d for d in runs["plugin"]["differences"] if d not in torch_own]
    assert not changed, "after the plugin's takes and restores, these differ from before it was imported:\n  " + (
        "\n  ".join(changed)
    )


def test_the_global_rngs_are_as_if_the_plugin_never_ran(runs):
    expected = runs["baseline"]["rng after train"]
    wrong = [
        f"{rng} {when}"
        for when in ("after train", "after restore")
        for rng, digest in runs["plugin"][f"rng {when}"].items()
        if digest != expected[rng]
    ]
    assert not wrong, (
        "these RNG states differ from a run without the plugin (the restores load the state saved "
        f"at train end, which is the state the run without the plugin ends with): {wrong}"
    )


def test_no_environment_variable_is_changed_while_a_snapshot_is_written(runs):
    probes = runs["plugin"]["probes"]
    assert probes, "the snapshot writes serialized the object entry"
    torch_own = {d.split(":")[0] for d in runs["baseline"]["differences"]}
    seen = {
        name: value
        for probe in probes
        for name, value in probe["env_changed"].items()
        if f"os.environ[{name!r}]" not in torch_own
    }
    assert not seen, (
        "while the plugin wrote a snapshot, these environment variables (process-wide: any other "
        f"torchsnapshot user or thread sees them) were set: {seen}"
    )
