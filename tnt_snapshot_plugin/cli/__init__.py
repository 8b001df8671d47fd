"""The ``tnt-snapshot`` command: list, inspect, verify, prune, diff and export snapshots.

The console script is always installed; its dependencies come with the ``cli`` extra
(``pip install 'tnt-snapshot-plugin[cli]'``: click and rich; safetensors for ``export``). Without
them the command prints one line saying so, and exits with status 2. Only the console script and
the demo import this package; the library never does. ``tnt-snapshot --version`` prints the
installed version.

Every command takes a local path, a ``file://`` URL or an ``s3://`` URL. For S3 the connection
comes from ``--endpoint-url`` / ``--region`` and from the environment variables boto3 reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, ...); S3 errors name
those (``app.CLI_S3_HINTS``), not the library's ``storage_options``.

Exit status: 0 success; 1 something was found damaged or different (``verify``, ``diff``), or a
command refused or failed to act (``prune``, a failed ``export`` write); 2 bad input (an unknown
option or bad value, a path that is not what the command needs, an output ``export`` cannot
write, a key holding nothing to export, a storage the options given cannot reach). Errors are
one line on stderr, never a traceback.

Every command reads snapshots as restore does: ``format.manifest`` parses and validates the
metadata, ``verify.check`` judges a snapshot. ``ls``, ``inspect``, ``verify`` and ``prune`` never
import torch; ``diff`` and ``export`` load entries with the plugin's format reader. One module a
command (``ls.py``, ``inspect.py``, ...); ``app.py`` the group and shared options, ``output.py``
what is printed, ``survey.py`` what a directory holds, ``entries.py`` a snapshot's entries.
"""

from __future__ import annotations

import sys
from typing import Optional

#: The one line the console script prints when the ``cli`` extra is not installed.
INSTALL_HINT = "tnt-snapshot needs the cli extra (click, rich): pip install 'tnt-snapshot-plugin[cli]'"

try:
    import click  # noqa: F401
    import rich  # noqa: F401
except ImportError as _missing:  # the console script is always installed; its dependencies are an extra
    _MISSING: Optional[ImportError] = _missing
else:
    _MISSING = None

if _MISSING is None:
    from tnt_snapshot_plugin.cli import convert, diff, export, inspect, ls, prune, verify  # noqa: F401  (each registers its command)
    from tnt_snapshot_plugin.cli.app import cli, main
    from tnt_snapshot_plugin.cli.output import safe
    from tnt_snapshot_plugin.cli.prune import PruneCandidate, select_for_pruning
    from tnt_snapshot_plugin.cli.survey import SnapshotInfo, check_snapshot, survey
else:

    def main(argv: Optional[list[str]] = None) -> int:  # type: ignore[misc]
        """The console script without the ``cli`` extra: one line saying how to install it."""
        print(f"{INSTALL_HINT} (missing: {getattr(_MISSING, 'name', None) or _MISSING})", file=sys.stderr)
        return 2

__all__ = ["PruneCandidate", "SnapshotInfo", "check_snapshot", "cli", "main", "safe", "select_for_pruning", "survey"]
