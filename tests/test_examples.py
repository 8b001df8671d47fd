"""The scripts in examples/: each runs as it stands, prints what it did, and checks its own claim.

Each example's ``main([...])`` runs in this process (``filterwarnings = error`` turns any warning
from the plugin into a failure); the torchtnt quickstart also runs as a script in a fresh
interpreter, exactly as its docstring says to run it. The S3 example runs against moto's S3
server on 127.0.0.1, with the environment's endpoint pointing at a closed port.

The examples mark the regions the README and the docs quote with pymdownx.snippets' markers
(``# --8<-- [start:NAME]`` ... ``# --8<-- [end:NAME]``). A quote in README.md or docs/*.md is a
```python block right after the line ``<!-- excerpt: examples/FILE.py NAME [NAME ...] -->``; it
must equal those regions byte for byte: each region's lines dedented, without leading or trailing
blank lines, the regions joined by one blank line (mkdocs pages may include the same regions with
``--8<-- "examples/FILE.py:NAME"`` lines, which are checked to name existing regions). Every
```python block of the README quotes an example, or says why not on the line before it
(``<!-- not an excerpt: WHY -->``); its two quickstarts quote whole programs, which run as pasted.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import ModuleType

import pytest
from dir_listing import snapshots_by_step
from moto_s3 import BUCKET, keys_under, moto_options

from tnt_snapshot_plugin import errors

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: Every example, and the test below that runs it.
TESTED = {
    "torchtnt_quickstart.py": "test_torchtnt_quickstart_resumes_bitwise",
    "lightning_quickstart.py": "test_lightning_quickstart_resumes_bitwise_with_ckpt_path_last",
    "switch_from_model_checkpoint.py": "test_switch_from_model_checkpoint_keeps_the_same_best",
    "finetune_from_weights.py": "test_finetune_loads_only_the_weights",
    "ema_plugin.py": "test_ema_plugin_saves_and_restores_the_average",
    "s3_endpoint.py": "test_s3_example_reaches_the_store_through_its_endpoint_url",
}
#: The most lines a quoted region has; the plugin example shows a whole class with its five hooks.
MAX_REGION_LINES = 16
LONGER_REGIONS = {("ema_plugin.py", "plugin"): 40}
MARKER = re.compile(r"--8<-- \[(start|end):([\w-]+)\]")
EXCERPT = re.compile(r"^<!-- excerpt: (examples/[\w.]+\.py)((?: [\w-]+)+) -->\n```python\n(.*?)^```", re.M | re.S)
NOT_AN_EXCERPT = re.compile(r"^<!-- not an excerpt: .+ -->$")
INCLUDE = re.compile(r'--8<-- "(examples/[\w.]+\.py):([\w-]+)"')

pytestmark = [pytest.mark.slow, pytest.mark.frameworks]


def load(name: str) -> ModuleType:
    """examples/<name> as a module (registered, as ``python examples/<name>`` would have it)."""
    module_name = f"example_{Path(name).stem}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def run(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run an example's ``main(argv)``; assert it succeeded; return the lines it printed."""
    status = load(name).main(argv)
    printed = capsys.readouterr().out
    assert status == 0, f"examples/{name} exited with {status}:\n{printed}"
    return printed.splitlines()


def in_order(expected: list[str], printed: list[str]) -> bool:
    """Whether ``printed`` holds the ``expected`` lines in that order (Lightning prints its model
    summary among them)."""
    remaining = iter(printed)
    return all(line in remaining for line in expected)


def regions(path: Path) -> dict[str, str]:
    """The marked regions of an example: name -> text (dedented, no leading or trailing blank lines)."""
    found: dict[str, str] = {}
    open_at: dict[str, int] = {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        match = MARKER.search(line)
        if match is None:
            continue
        kind, name = match.groups()
        assert line.strip().startswith("#"), f"{path.name}:{number + 1}: a marker outside a comment"
        if kind == "start":
            assert name not in open_at and name not in found, f"{path.name}: region {name!r} opened twice"
            open_at[name] = number
        else:
            assert name in open_at, f"{path.name}:{number + 1}: region {name!r} ends before it starts"
            body = lines[open_at.pop(name) + 1 : number]
            assert not any(MARKER.search(inner) for inner in body), f"{path.name}: regions overlap in {name!r}"
            found[name] = textwrap.dedent("\n".join(body)).strip("\n") + "\n"
    assert not open_at, f"{path.name}: regions never closed: {sorted(open_at)}"
    return found


def excerpt_problems(markdown: str, where: str) -> list[str]:
    """What is wrong with the quotes of examples in a page (empty: each is byte for byte)."""
    problems = []
    for file, names, block in EXCERPT.findall(markdown):
        path = ROOT / file
        if not path.is_file():
            problems.append(f"{where}: quotes {file}, which does not exist")
            continue
        marked = regions(path)
        missing = [n for n in names.split() if n not in marked]
        if missing:
            problems.append(f"{where}: {file} has no region {missing}")
        elif block != "\n".join(marked[n] for n in names.split()):
            problems.append(f"{where}: the quote of {file} {names.strip()} differs from the example")
    for file, name in INCLUDE.findall(markdown):
        path = ROOT / file
        if not path.is_file() or name not in regions(path):
            problems.append(f"{where}: includes {file}:{name}, which does not exist")
    return problems


# -- the examples run ---------------------------------------------------------------------------


def test_torchtnt_quickstart_resumes_bitwise(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the quickstart writes to checkpoints/run1, as the README's does
    printed = run("torchtnt_quickstart.py", [], capsys)
    assert printed == [
        "first run: stopped at step 35; newest snapshot: checkpoints/run1/epoch_1_step_25",
        "second run: resumed and trained to step 50",
        "the resumed run equals an uninterrupted one bitwise: True",
    ]
    # an epoch-end snapshot of each epoch; the second run's ends where the first run's would have
    assert snapshots_by_step(tmp_path / "checkpoints" / "run1") == ["epoch_1_step_25", "epoch_2_step_50"]
    # a second time in the same directory: refused, so the crash it simulates is never skipped
    assert load("torchtnt_quickstart.py").main([]) == 2
    assert "checkpoints/run1 exists already" in capsys.readouterr().err


def test_torchtnt_quickstart_runs_as_a_script_as_its_docstring_says(tmp_path):
    """``python examples/torchtnt_quickstart.py`` in a fresh interpreter, in an empty working
    directory: its exit status, its output, no warning from the plugin."""
    script = EXAMPLES / "torchtnt_quickstart.py"
    assert "python examples/torchtnt_quickstart.py\n" in (load(script.name).__doc__ or "")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "the resumed run equals an uninterrupted one bitwise: True"
    assert snapshots_by_step(tmp_path / "checkpoints" / "run1") == ["epoch_1_step_25", "epoch_2_step_50"]
    assert "Traceback" not in done.stderr
    assert not plugin_warnings(done.stderr), done.stderr


def plugin_warnings(stderr: str) -> list[str]:
    """The warnings in ``stderr`` issued by the plugin's code or of the plugin's categories;
    except SnapshotBusyWarning, which depends on the machine's speed (as in setup.cfg)."""
    ours = {name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, Warning)}
    found = []
    for line in stderr.splitlines():
        match = re.match(r"^(.+?):\d+: (\w+): ", line)
        if match is None or match.group(2) == "SnapshotBusyWarning":
            continue
        path, category = match.groups()
        if category in ours or any(Path(path).is_relative_to(ROOT / d) for d in ("tnt_snapshot_plugin", "adapters", "examples")):
            found.append(line)
    return found


def test_lightning_quickstart_resumes_bitwise_with_ckpt_path_last(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the quickstart writes to checkpoints/lightning, as the README's does
    printed = run("lightning_quickstart.py", [], capsys)
    expected = [
        "first run: stopped at step 35; snapshots: ['epoch_1_step_25']",
        "second run: resumed and trained to step 50",
        "the resumed run equals an uninterrupted one bitwise: True",
    ]
    assert in_order(expected, printed), printed
    assert snapshots_by_step(tmp_path / "checkpoints" / "lightning") == ["epoch_1_step_25", "epoch_2_step_50"]


def test_switch_from_model_checkpoint_keeps_the_same_best(tmp_path, capsys):
    printed = run("switch_from_model_checkpoint.py", ["--dirpath", str(tmp_path)], capsys)
    assert printed[-1] == "both pick the same best step with the same val_loss: True"
    theirs = {int(re.search(r"step=(\d+)", n)[1]) for n in os.listdir(tmp_path / "model_checkpoint" / "checkpoints")}
    ours = snapshots_by_step(tmp_path / "snapshots" / "checkpoints")
    steps = {int(n.split("_")[3]) for n in ours}
    # ModelCheckpoint's 2 best are kept, and the newest snapshot (5 epochs of 12 steps)
    assert len(theirs) == 2 and theirs <= steps and steps - theirs <= {60}
    assert all("_val_loss=" in n for n in ours)
    best = [line for line in printed if ": best " in line]
    assert best[0].startswith("ModelCheckpoint: best ") and best[1].startswith("TorchSnapshotSaver: best ")
    assert os.path.basename(best[1].rsplit(" ", 1)[1]) in ours


def test_finetune_loads_only_the_weights(tmp_path, capsys):
    printed = run("finetune_from_weights.py", ["--dirpath", str(tmp_path)], capsys)
    assert printed[0] == f"pre-trained 60 steps; latest snapshot: {tmp_path / 'pretrain' / 'epoch_3_step_60'}"
    assert printed[1] == "weights loaded: True; progress and optimizer new: True"
    before, after = (float(line.rsplit(" ", 1)[1]) for line in printed[2:4])
    assert after < before  # the fine-tuning trained the loaded weights on the new task
    assert snapshots_by_step(tmp_path / "finetune") == ["epoch_2_step_40"]  # its steps count from 0


def test_ema_plugin_saves_and_restores_the_average(tmp_path, capsys):
    printed = run("ema_plugin.py", ["--dirpath", str(tmp_path)], capsys)
    committed = [line.split("/")[-1] for line in printed if line.startswith("committed ")]
    # the epoch cadence (40 steps an epoch), the plugin's step 60, the loss in every name
    assert [re.sub(r"=[\d.]+$", "", name) for name in committed] == [
        "epoch_1_step_40_loss", "epoch_1_step_60_loss", "epoch_2_step_80_loss",
        "epoch_3_step_120_loss", "epoch_4_step_160_loss",
    ]
    assert snapshots_by_step(tmp_path) == committed
    resumed = next(line for line in printed if line.startswith("resumed from "))
    assert resumed == (
        f"resumed from {tmp_path / committed[2]}: ['ema', 'model', 'optimizer', 'rng_state', 'train_progress']"
    )
    assert printed[-1] == "weights and EMA equal an uninterrupted run's bitwise: True"


@pytest.fixture
def s3_environment(no_aws_environment, monkeypatch):
    """Dummy credentials in the environment, where the example reads them; the environment's
    endpoint is a closed port, so only the example's ``endpoint_url`` reaches the server."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


def test_s3_example_reaches_the_store_through_its_endpoint_url(moto_endpoint, s3_environment, capsys):
    dirpath = f"s3://{BUCKET}/example-{uuid.uuid4().hex[:8]}"
    printed = run("s3_endpoint.py", ["--endpoint-url", moto_endpoint, "--dirpath", dirpath, "--create-bucket"], capsys)
    assert printed == [
        f"latest snapshot: {dirpath}/epoch_2_step_200",
        "restored at step 200; weights equal the trained ones: True",
    ]
    keys = set(keys_under(moto_options(moto_endpoint), dirpath))
    assert {"epoch_1_step_100/.snapshot_metadata", "epoch_2_step_200/.snapshot_metadata"} <= keys


# -- what the examples are made of ---------------------------------------------------------------


def test_every_example_is_listed_and_run_by_a_test():
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == sorted(TESTED)
    tests = {name for name, value in globals().items() if name.startswith("test_") and callable(value)}
    assert set(TESTED.values()) <= tests
    listing = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert f"`{name}`" in listing, f"examples/README.md does not list {name}"


@pytest.mark.parametrize("name", sorted(TESTED))
def test_each_example_is_a_script_a_user_copies(name):
    """A docstring saying how to run it, ``main(argv=None)``, the usual ``__main__`` guard, and
    only the plugin's public imports."""
    source = (EXAMPLES / name).read_text()
    tree = ast.parse(source)
    doc = ast.get_docstring(tree) or ""
    assert f"python examples/{name}" in doc
    main = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "main")
    assert [a.arg for a in main.args.args] == ["argv"] and isinstance(main.args.defaults[0], ast.Constant)
    assert source.rstrip().endswith('if __name__ == "__main__":\n    sys.exit(main())')
    public = {"tnt_snapshot_plugin", "tnt_snapshot_plugin.adapters.torchtnt", "tnt_snapshot_plugin.adapters.lightning"}
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    ours = {module for module in imported if module and module.split(".")[0] == "tnt_snapshot_plugin"}
    assert ours and ours <= public, ours - public


@pytest.mark.parametrize("name", sorted(TESTED))
def test_each_example_marks_short_regions_to_quote(name):
    marked = regions(EXAMPLES / name)
    assert "imports" in marked and len(marked) >= 2, sorted(marked)
    assert "from tnt_snapshot_plugin" in marked["imports"]
    for region, text in marked.items():
        limit = LONGER_REGIONS.get((name, region), MAX_REGION_LINES)
        assert len(text.splitlines()) <= limit, f"{name}:{region} has {len(text.splitlines())} lines"
        ast.parse(text)  # each region is whole statements


def test_the_readme_and_the_docs_quote_the_examples_byte_for_byte():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    problems = [p for page in pages for p in excerpt_problems(page.read_text(), page.name)]
    assert not problems, "\n".join(problems)


def test_every_python_block_of_the_readme_quotes_an_example_or_says_why_not():
    lines = (ROOT / "README.md").read_text().splitlines()
    unmarked = [
        f"README.md:{n + 1}" for n, line in enumerate(lines)
        if line == "```python" and not (n and (lines[n - 1].startswith("<!-- excerpt: ") or NOT_AN_EXCERPT.match(lines[n - 1])))
    ]
    assert not unmarked, f"python blocks that neither quote an example nor say why not: {unmarked}"
    # the quickstarts are whole programs: the imports, the model, the data and the quickstart itself
    quoted = {file: names.split() for file, names, _ in EXCERPT.findall((ROOT / "README.md").read_text())}
    whole = ["imports", "model", "data", "quickstart"]
    assert quoted.get("examples/torchtnt_quickstart.py") == whole, quoted
    assert quoted.get("examples/lightning_quickstart.py") == whole, quoted


def test_a_quote_that_differs_from_its_example_is_found():
    """The check above on made-up pages: an exact quote passes; an edited one, a region that does
    not exist and an include of a missing region are each reported."""
    quickstart = regions(EXAMPLES / "torchtnt_quickstart.py")
    exact = "\n".join([quickstart["imports"], quickstart["quickstart"]])
    page = f"# Title\n\n<!-- excerpt: examples/torchtnt_quickstart.py imports quickstart -->\n```python\n{exact}```\n"
    assert excerpt_problems(page, "page.md") == []
    assert excerpt_problems(page.replace("keep_last_n_snapshots=2", "keep_last_n_snapshots=3"), "page.md") == [
        "page.md: the quote of examples/torchtnt_quickstart.py imports quickstart differs from the example"
    ]
    assert excerpt_problems(page.replace(" quickstart -->", " quick -->"), "page.md") == [
        "page.md: examples/torchtnt_quickstart.py has no region ['quick']"
    ]
    included = '```python\n--8<-- "examples/torchtnt_quickstart.py:quickstart"\n--8<-- "examples/ema_plugin.py:nothing"\n```\n'
    assert excerpt_problems(included, "page.md") == ["page.md: includes examples/ema_plugin.py:nothing, which does not exist"]
    assert in_order(["a", "c"], ["a", "b", "c"]) and not in_order(["c", "a"], ["a", "b", "c"])


def test_the_script_runs_warning_check_finds_the_plugins_warnings():
    stderr = "\n".join([
        "/x/torchtnt/framework/_callback_handler.py:122: SnapshotsAheadWarning: s3://b/run holds snapshots ahead",
        f"{ROOT}/adapters/torchtnt_restore.py:290: UserWarning: train_dataloader was passed to restore",
        f"{ROOT}/tnt_snapshot_plugin/events.py:200: SnapshotBusyWarning: snapshot epoch_1_step_40 was still being written",
        "/x/torchtnt/utils/version.py:12: UserWarning: pkg_resources is deprecated as an API.",
        "  import pkg_resources",
    ])
    assert plugin_warnings(stderr) == stderr.splitlines()[:2]
