"""The ``tnt-snapshot`` command line on wrong input: every command, given a path that is not what
it needs, an output it cannot write, a key that holds nothing to export, a bad option value or
an S3 endpoint that refuses, answers with one line on stderr and exit status 2, never a
traceback; and the edges where a correct answer exists give it (``ls`` of one snapshot, the
holder of a dirpath's lock, ``export`` of an optimizer's state, a failed export's write).

The snapshots come from a real torchtnt ``train`` run. The S3 cases need no server: the
endpoint is a loopback port nothing listens on (the connection is refused), or a value boto3
refuses before any request. moto's server covers the S3 cases that need a bucket
(tests/test_cli_s3.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torchtnt.framework.train import train

from tnt_snapshot_plugin.adapters.torchtnt import TorchSnapshotSaver
from tnt_snapshot_plugin.cli import cli
from tnt_snapshot_plugin.errors import StorageUnavailableError
from tnt_snapshot_plugin.format.index import INDEX_FNAME
from tnt_snapshot_plugin.format.torchsnapshot.common import METADATA_FNAME
from tnt_snapshot_plugin.stores import LOCK_FNAME, open_store
from tnt_snapshot_plugin.stores.s3 import S3Hints, hints_for
from toy import Holder, StatefulLoader, ToyUnit, assert_bitwise_equal, make_data, small_disk

pytestmark = pytest.mark.slow

SNAPSHOT = "epoch_2_step_10"  # the run's last snapshot: its state is the unit's after training


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Snapshots of one real torchtnt run, and the unit as training left it."""
    root = tmp_path_factory.mktemp("edges")
    unit = ToyUnit()
    saver = TorchSnapshotSaver(str(root / "run"), save_every_n_train_steps=4, save_every_n_epochs=1)
    train(unit, StatefulLoader(make_data(20)), max_epochs=2, callbacks=[saver])
    assert SNAPSHOT in os.listdir(root / "run")
    return root / "run", unit


@pytest.fixture(autouse=True)
def no_aws_environment(monkeypatch):
    """No credentials or endpoint from the environment or ~/.aws: each case sets its own."""
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def refused_endpoint() -> str:
    """A loopback URL nothing listens on: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def run_cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def fresh_copy(written, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(written[0], run)
    return run


# -- every command over bad input ----------------------------------------------------------------

#: Credentials that let a request go out (to an endpoint that refuses it); one attempt, so a
#: refused connection fails at once instead of after the retries users get.
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_MAX_ATTEMPTS": "1"}
S3_SNAPSHOT = f"s3://bucket/run/{SNAPSHOT}"

# (id, arguments, a fragment the one line must hold, environment). In the arguments: {run} the
# directory of snapshots, {snap} one of its snapshots, {file} a file, {missing} a path that does
# not exist, {out} a file to export to in an empty folder, {folder} that folder, {refused} an S3
# endpoint that refuses connections.
BAD_INPUT = [
    ("ls-missing", ["ls", "{missing}"], "does not exist", {}),
    ("ls-file", ["ls", "{file}"], "is a file, not a directory of snapshots", {}),
    ("ls-empty-path", ["ls", ""], "Invalid value for 'DIRPATH': an empty path", {}),
    ("ls-unknown-scheme", ["ls", "nosuchscheme://x/run"], "'nosuchscheme'", {}),
    ("ls-unknown-option", ["ls", "{run}", "--colour"], "No such option '--colour'", {}),
    ("inspect-missing", ["inspect", "{missing}"], "does not exist", {}),
    ("inspect-dirpath", ["inspect", "{run}"], "is a directory of snapshots, not a snapshot", {}),
    ("inspect-file", ["inspect", "{file}"], "is a file, not a snapshot directory", {}),
    ("inspect-inside-a-snapshot", ["inspect", "{snap}/0"], "is not a complete snapshot", {}),
    ("inspect-no-bucket", ["inspect", "s3://"], "names no bucket", {}),
    ("verify-missing", ["verify", "{missing}"], "does not exist", {}),
    ("verify-file", ["verify", "{file}"], "is a file", {}),
    ("verify-missing-snapshot", ["verify", "{run}/epoch_9_step_90"], "does not exist", {}),
    ("diff-missing", ["diff", "{snap}", "{missing}"], "does not exist", {}),
    ("diff-dirpath", ["diff", "{run}", "{snap}"], "is a directory of snapshots, not a snapshot", {}),
    ("diff-one-argument", ["diff", "{snap}"], "Missing argument 'B'", {}),
    ("export-missing-folder", ["export", "{snap}", "{folder}/no/such/model.pt"], "the folder of OUT", {}),
    ("export-into-a-file", ["export", "{snap}", "{file}/model.pt"], "is not a folder", {}),
    ("export-to-a-folder", ["export", "{snap}", "{folder}"], "is a folder; name a file in it", {}),
    ("export-to-a-url", ["export", "{snap}", "s3://bucket/model.pt"], "is a URL; export writes a local file", {}),
    ("export-empty-out", ["export", "{snap}", ""], "Invalid value for 'OUT': an empty path", {}),
    ("export-missing-key", ["export", "{snap}", "{out}", "--key", "nope"], "has no entry 'nope'", {}),
    ("export-missing-subkey", ["export", "{snap}", "{out}", "--key", "model/nope"], "has no 'nope'", {}),
    ("export-key-without-tensors", ["export", "{snap}", "{out}", "--key", "train_progress"],
     "holds no tensors (3 other values)", {}),
    ("export-safetensors-of-other-values", ["export", "{snap}", "{folder}/o.safetensors", "--key", "optimizer"],
     "cannot export 'optimizer' as safetensors", {}),
    ("export-dirpath", ["export", "{run}", "{out}"], "is a directory of snapshots", {}),
    ("export-bad-format", ["export", "{snap}", "{out}", "--format", "onnx"], "Invalid value for '--format'", {}),
    ("prune-a-snapshot", ["prune", "{snap}", "--keep-last", "1"], "is a snapshot, not a directory of snapshots", {}),
    ("prune-missing", ["prune", "{missing}", "--keep-last", "1"], "does not exist", {}),
    ("prune-keep-last-0", ["prune", "{run}", "--keep-last", "0"], "Invalid value for '--keep-last'", {}),
    ("prune-no-keep-last", ["prune", "{run}"], "Missing option '--keep-last'", {}),
    ("prune-bad-duration", ["prune", "{run}", "--keep-last", "1", "--min-staging-age", "soon"],
     "'soon' is not a duration", {}),
    ("prune-mode-alone", ["prune", "{run}", "--keep-last", "1", "--mode", "max"], "--keep-best and --mode go together", {}),
    ("s3-bad-endpoint", ["ls", "s3://bucket/run", "--endpoint-url", "not-a-url"], "check --endpoint-url", CREDS),
    ("s3-bad-region", ["ls", "s3://bucket/run", "--region", "no such region"], "check --region", CREDS),
    ("s3-no-credentials", ["inspect", S3_SNAPSHOT, "--endpoint-url", "{refused}"],
     "no credentials (Unable to locate credentials); pass them in the environment (AWS_ACCESS_KEY_ID", {}),
    *(
        (f"s3-refused-{name}", [*args, "--endpoint-url", "{refused}"],
         "could not be reached (EndpointConnectionError", CREDS)
        for name, args in (
            ("ls", ["ls", "s3://bucket/run"]),
            ("ls-snapshot", ["ls", S3_SNAPSHOT]),
            ("inspect", ["inspect", S3_SNAPSHOT]),
            ("verify", ["verify", "s3://bucket/run"]),
            ("diff", ["diff", S3_SNAPSHOT, "s3://bucket/run/epoch_1_step_8"]),
            ("export", ["export", S3_SNAPSHOT, "{out}"]),
            ("prune", ["prune", "s3://bucket/run", "--keep-last", "1"]),
        )
    ),
]


@pytest.mark.parametrize(("args", "fragment", "env"), [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_every_command_answers_bad_input_in_one_line_with_exit_status_2(written, tmp_path, monkeypatch, args,
                                                                       fragment, env):
    run = fresh_copy(written, tmp_path)
    folder = tmp_path / "out"
    folder.mkdir()
    (tmp_path / "notes.txt").write_text("a file\n")
    values = {"run": str(run), "snap": str(run / SNAPSHOT), "file": str(tmp_path / "notes.txt"),
              "missing": str(tmp_path / "missing"), "out": str(folder / "model.pt"), "folder": str(folder),
              "refused": refused_endpoint()}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    code, out, err = run_cli(*(a.format(**values) for a in args))

    assert code == 2, (out, err)
    assert out == "" and err.count("\n") == 1 and err.startswith("tnt-snapshot: error: "), err
    assert fragment in err, err
    assert "Traceback" not in err and "storage_options" not in err
    assert os.listdir(folder) == []  # no output, no part of one
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing touched


# -- export --------------------------------------------------------------------------------------


def test_export_of_an_optimizer_writes_its_whole_state_and_counts_what_it_wrote(written, tmp_path):
    run, unit = written
    out = tmp_path / "optimizer.pt"
    code, text, err = run_cli("export", str(run / SNAPSHOT), str(out), "--key", "optimizer")
    expected = unit.optimizer.state_dict()
    tensors = sum(len(s) for s in expected["state"].values())
    assert code == 0, err
    assert f"exported optimizer ({tensors} tensors, " in text and "other values)" in text
    exported = torch.load(out, weights_only=True)
    assert exported["param_groups"] == expected["param_groups"]
    assert exported["state"].keys() == expected["state"].keys()
    for param, state in expected["state"].items():
        assert_bitwise_equal(exported["state"][param], state)

    doc = json.loads(run_cli("export", str(run / SNAPSHOT), str(out), "--key", "optimizer", "--force", "--json")[1])
    others = leaf_count(expected["param_groups"])  # lr, betas' two, ..., params' indices
    assert (doc["tensors"], doc["other_values"]) == (tensors, others) and f"; {others} other values)" in text
    assert doc["bytes"] == sum(t.numel() * t.element_size() for s in expected["state"].values() for t in s.values())


def test_tensors_whose_keys_join_to_one_name_are_not_written_as_safetensors(tmp_path):
    """``{"a.b": x, "a": {"b": y}}``: both keys join to "a.b"; a safetensors file would keep
    one tensor. export and convert refuse it, naming the name; torch.save keeps both."""
    from tnt_snapshot_plugin import SnapshotConfig, Snapshotter

    run = tmp_path / "run"
    state = {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}
    Snapshotter(str(run), SnapshotConfig.build(async_snapshot=False)).save(0, 1, {"w": Holder(state)})
    snapshot = str(run / "epoch_0_step_1")
    for args in (
        ("export", snapshot, str(tmp_path / "w.safetensors"), "--key", "w"),
        ("convert", snapshot, str(tmp_path / "w_folder"), "--to", "safetensors", "--key", "w"),
    ):
        code, _out, err = run_cli(*args)
        assert code == 2 and "'a.b'" in err and "keep only one" in err, err
        assert not os.path.exists(args[2])
    code, _out, err = run_cli("export", snapshot, str(tmp_path / "w.pt"), "--key", "w")
    assert code == 0, err
    exported = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(exported["a.b"], state["a.b"]) and torch.equal(exported["a"]["b"], state["a"]["b"])


def leaf_count(obj) -> int:
    if isinstance(obj, dict):
        return sum(leaf_count(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(leaf_count(v) for v in obj)
    return 1


def test_a_failed_export_leaves_no_file_and_says_why_in_one_line(written, tmp_path):
    """A real full disk (a tmpfs of 64 KiB, nearly filled): the write fails part-way; OUT is
    neither created nor replaced, and no temporary file is left."""
    run, _ = written
    with small_disk(tmp_path / "disk", 64 * 1024) as disk:
        (disk / "model.pt").write_bytes(b"an older export")
        (disk / "fill").write_bytes(b"x" * (60 * 1024 - 1000))  # what is left: less than a page
        for name, key in (("optimizer.pt", "optimizer"), ("model.safetensors", "model")):
            code, out, err = run_cli("export", str(run / SNAPSHOT), str(disk / name), "--key", key)
            assert code == 1 and out == "" and err.count("\n") == 1, err
            assert f"could not write {disk / name}" in err and "No space left on device" in err
            assert sorted(os.listdir(disk)) == ["fill", "model.pt"]
        code, _, err = run_cli("export", str(run / SNAPSHOT), str(disk / "model.pt"), "--key", "optimizer", "--force")
        assert code == 1 and "No space left on device" in err
        assert (disk / "model.pt").read_bytes() == b"an older export" and sorted(os.listdir(disk)) == ["fill", "model.pt"]


# -- ls ------------------------------------------------------------------------------------------


def test_ls_of_one_snapshot_lists_its_files_as_its_own(written, tmp_path):
    run = fresh_copy(written, tmp_path)
    snap = run / SNAPSHOT
    files = sorted(str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file())

    for target in (str(snap), f"{snap}/", f"file://{snap}", str(snap / METADATA_FNAME)):
        code, out, err = run_cli("ls", target)
        assert code == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["FILE", "ROLE", "SIZE", "MODIFIED"]
        assert [line.split()[0] for line in lines[1:-1]] == files
        assert "foreign" not in out
        assert lines[-1].startswith(f"{snap}: complete; {len(files)} files, ")
        assert "epoch 2, step 10; world size 1; committed " in lines[-1]

    doc = json.loads(run_cli("ls", str(snap), "--json")[1])
    roles = {f["path"]: f["role"] for f in doc["files"]}
    assert roles[METADATA_FNAME] == "metadata" and roles[INDEX_FNAME] == "index"
    assert {roles[f] for f in files if not f.startswith(".")} == {"payload"}
    assert doc["snapshot"] == str(snap) and doc["entry"]["status"] == "complete" and doc["entry"]["step"] == 10

    # Damaged and incomplete: said in the listing, as the directory's listing says it.
    rel = max(json.loads((snap / INDEX_FNAME).read_text())["files"].items(), key=lambda kv: kv[1])[0]
    (snap / rel).write_bytes((snap / rel).read_bytes()[:10])
    code, out, _ = run_cli("ls", str(snap))
    assert code == 0 and f"{snap}: damaged;" in out and f"{SNAPSHOT}: file {rel} has 10 bytes" in out
    (snap / METADATA_FNAME).unlink()
    code, out, _ = run_cli("ls", str(snap))
    assert code == 0 and f"{snap}: incomplete;" in out and f"{METADATA_FNAME} or .metadata is missing" in out


def test_ls_of_a_directory_is_not_taken_for_one_snapshot(written, tmp_path):
    """The directory of snapshots, and a directory named like a snapshot that holds snapshots,
    are listed as directories."""
    run = fresh_copy(written, tmp_path)
    nested = tmp_path / "epoch_7_step_70"
    shutil.copytree(run, nested)
    for dirpath in (run, nested):
        doc = json.loads(run_cli("ls", str(dirpath), "--json")[1])
        assert doc["restore"] == SNAPSHOT and {e["status"] for e in doc["entries"]} == {"complete"}


def test_ls_names_a_lock_whose_holder_is_gone(written, tmp_path):
    """A lock file left by a killed run (the kernel dropped its lock): its holder, and why it is
    known to be gone, in the table and in --json."""
    run = fresh_copy(written, tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = int(proc.stdout)
    started = time.time() - 60
    record = {"host": socket.gethostname(), "pid": dead, "run_id": "0123456789ab", "started_at": started}
    (run / LOCK_FNAME).write_text(json.dumps(record))
    code, out, _ = run_cli("ls", str(run))
    row = next(line for line in out.splitlines() if line.startswith(LOCK_FNAME))
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
    assert code == 0 and row.endswith(
        f"lock, left by host '{record['host']}' pid {dead} run '0123456789ab' since {since} "
        f"(its process {dead} is dead)"
    )
    doc = json.loads(run_cli("ls", str(run), "--json")[1])
    assert next(e for e in doc["entries"] if e["name"] == LOCK_FNAME)["holder"] == record


# -- S3 errors: named as their caller gives the settings -------------------------------------------


def test_s3_errors_name_the_settings_as_the_store_builder_gives_them(monkeypatch):
    """A store keeps the hints it was built with, in every error it raises, on every thread
    (ranged reads fetch on worker threads); stores built elsewhere keep storage_options'."""
    for key, value in CREDS.items():
        monkeypatch.setenv(key, value)
    opts = {"endpoint_url": refused_endpoint()}
    cli_like = S3Hints(endpoint="--endpoint", region="--region", credentials="the environment")

    library = open_store("s3://bucket/run", opts)
    with pytest.raises(StorageUnavailableError, match=r"check storage_options \(endpoint_url\) and the network"):
        library.list_names()

    with hints_for(cli_like):
        store = open_store("s3://bucket/run", opts)
    for call in (store.list_names, lambda: store.read_file(SNAPSHOT, METADATA_FNAME),
                 lambda: store.nested(SNAPSHOT).list_names(),
                 lambda: store.read_into(SNAPSHOT, [("batched/0-0", 0, memoryview(bytearray(8)))])):
        with pytest.raises(StorageUnavailableError, match="check --endpoint and the network") as info:
            call()
        assert "storage_options" not in str(info.value)
    with pytest.raises(StorageUnavailableError, match=r"storage_options \(endpoint_url\)"):
        open_store("s3://bucket/run", opts).list_names()  # built after the block: the library's
