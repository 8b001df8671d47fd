"""The ``tnt-snapshot`` command: list, inspect, verify, prune, diff and export snapshots.

Installed with the ``cli`` extra (``pip install 'tnt-snapshot-plugin[cli]'``: click and rich), and
imported only by the console script: the rest of the package never imports this module.

Every command takes a local path, a ``file://`` URL or an ``s3://`` URL. For S3 the connection
comes from ``--endpoint-url`` / ``--region`` and from the environment variables boto3 reads
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, ...).

Exit status: 0 success; 1 something was found damaged or different (``verify``, ``diff``), or a
command refused or failed to act (``prune``); 2 bad input (an unknown option, a path that is not
what the command needs). Errors are one line on stderr.

Every command reads snapshots as restore does: ``format.manifest`` parses and validates the
metadata, ``verify.check`` judges a snapshot. ``ls``, ``inspect``, ``verify`` and ``prune`` never
import torch; ``diff`` and ``export`` load entries with the plugin's format reader. One module a
command (``ls.py``, ``inspect.py``, ...); ``app.py`` the group and shared options, ``output.py``
what is printed, ``survey.py`` what a directory holds, ``entries.py`` a snapshot's entries.
"""

from __future__ import annotations

from . import diff, export, inspect, ls, prune, verify  # noqa: F401  (each registers its command)
from .app import cli, main
from .output import safe
from .prune import PruneCandidate, select_for_pruning
from .survey import SnapshotInfo, check_snapshot, survey

__all__ = ["PruneCandidate", "SnapshotInfo", "check_snapshot", "cli", "main", "safe", "select_for_pruning", "survey"]
