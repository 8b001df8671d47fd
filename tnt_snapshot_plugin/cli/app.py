"""The ``tnt-snapshot`` command group: how errors become one line and an exit status, and the
options and path handling every command shares."""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional

import click

from tnt_snapshot_plugin.cli.output import safe
from tnt_snapshot_plugin.errors import (
    ConfigError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    StorageUnavailableError,
)
from tnt_snapshot_plugin.format import listing
from tnt_snapshot_plugin.format.registry import metadata_files
from tnt_snapshot_plugin.stores import Store, open_store
from tnt_snapshot_plugin.stores.s3 import S3Hints, hints_for, s3_error

#: How S3 errors met by a command name the connection's settings: the command's options and the
#: environment variables boto3 reads, not the library's ``storage_options``.
CLI_S3_HINTS = S3Hints(
    endpoint="--endpoint-url (or AWS_ENDPOINT_URL_S3)",
    region="--region (or AWS_REGION)",
    credentials="the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN; or AWS_PROFILE)",
)

#: Errors that say the input is wrong (exit status 2): a path or URL that is not what the command
#: needs, a damaged snapshot named by path, a storage the options given cannot reach or read.
BAD_INPUT = (ConfigError, SnapshotNotFoundError, SnapshotCorruptError, StorageUnavailableError)


class UsageProblem(click.UsageError):
    """Bad input found after parsing (a path that is not what the command needs): exit 2."""


def _not_empty(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not value.strip():
        where = "name the file to write" if param.name == "out_path" else "give a local path, a file:// or an s3:// URL"
        raise click.BadParameter(f"an empty path; {where}")
    return value


def path_argument(name: str, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A path or URL argument: an empty one is refused as bad input, naming the argument."""
    return click.argument(name, callback=_not_empty, **kwargs)


def s3_options(endpoint_url: Optional[str], region: Optional[str]) -> Optional[dict[str, Any]]:
    opts = {k: v for k, v in (("endpoint_url", endpoint_url), ("region_name", region)) if v}
    return opts or None


def open_target(target: str, storage_options: Optional[dict[str, Any]], what: str = "directory") -> Store:
    try:
        return open_store(target, storage_options if target.startswith("s3://") else None)
    except ConfigError as exc:
        raise UsageProblem(str(exc)) from None


def split_path(target: str) -> tuple[str, str]:
    """(the directory, the snapshot's name) of a snapshot's path or URL (its metadata file's:
    that snapshot); UsageProblem where it names no snapshot."""
    text = target.rstrip("/")
    scheme, sep, rest = target.partition("://")
    if sep and not rest.strip("/"):
        raise UsageProblem(f"{target!r} names no {'bucket' if scheme == 's3' else 'path'}, not a snapshot")
    for metadata in metadata_files():  # a snapshot's metadata file: that snapshot
        if text.endswith("/" + metadata):
            text = text[: -len(metadata) - 1]
            break
    head, sep, name = text.rpartition("/")
    if not name or name in (".", ".."):
        raise UsageProblem(f"{target!r} does not name a snapshot (expected DIRPATH/epoch_E_step_S)")
    if not sep:
        head = "."
    elif not head and "://" not in text:
        head = "/"  # a local absolute path: /name
    elif head == "file://":
        head = "/"  # file:///name
    elif not head or head.endswith(":/"):
        raise UsageProblem(f"{target!r} names a bucket or root, not a snapshot")
    return head, name


def split_target(target: str, storage_options: Optional[dict[str, Any]]) -> tuple[Store, str]:
    """The store of a snapshot's directory and the snapshot's name, for a command that reads it."""
    head, name = split_path(target)
    store = open_target(head, storage_options)
    _not_a_directory_of_snapshots(store, name, target, storage_options)
    return store, name


def _not_a_directory_of_snapshots(
    store: Store, name: str, target: str, storage_options: Optional[dict[str, Any]]
) -> None:
    """A command that reads one snapshot was given a directory of them (a dirpath): say so,
    naming the newest, rather than "not a complete snapshot"."""
    if listing.is_complete(store, name):
        return
    inner = open_target(store.child(name), storage_options)
    names = listing.complete_names(inner)
    if names:
        raise UsageProblem(
            f"{target} is a directory of snapshots, not a snapshot: {listing.describe(inner)}; "
            f"name one, e.g. {inner.child(names[-1])}"
        )


def duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(body) * units[unit]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90, 90s, 15m, 2h)") from None
    if value < 0 or math.isnan(value):
        raise click.BadParameter(f"{text!r}: a duration must be >= 0")
    return value


def s3_flags(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--region", default=None, help="S3 region (else AWS_REGION / AWS_DEFAULT_REGION).")(f)
    f = click.option(
        "--endpoint-url", default=None, help="S3 endpoint (else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL)."
    )(f)
    return f


json_flag = click.option("--json", "as_json", is_flag=True, help="Machine-readable output (stable keys).")


class _Cli(click.Group):
    """Errors as one line on stderr: exit 2 for bad input, 1 for a failure."""

    def main(self, args: Any = None, prog_name: Optional[str] = None, complete_var: Optional[str] = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        prog = prog_name or "tnt-snapshot"
        try:
            with hints_for(CLI_S3_HINTS):
                rv = super().main(args, prog, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.UsageError as exc:
            if type(exc).__name__ == "NoArgsIsHelpError" and exc.ctx is not None:  # bare "tnt-snapshot"
                click.echo(exc.ctx.get_help(), err=True)
                code = 2
                if standalone_mode:
                    sys.exit(code)
                return code
            hint = (
                f" (see '{exc.ctx.command_path} --help')"
                if exc.ctx is not None and not isinstance(exc, UsageProblem)
                else ""
            )
            code = fail(prog, exc.format_message() + hint, 2)
        except click.ClickException as exc:
            code = fail(prog, exc.format_message(), exc.exit_code)
        except click.Abort:
            code = fail(prog, "aborted", 1)
        except BAD_INPUT as exc:
            code = fail(prog, str(exc), 2)
        except (SnapshotError, OSError) as exc:
            code = fail(prog, str(exc), 1)
        except Exception as exc:
            mapped = s3_error("S3", exc, CLI_S3_HINTS) if type(exc).__module__.startswith("botocore") else None
            if mapped is None:
                raise
            code = fail(prog, str(mapped), 2 if isinstance(mapped, BAD_INPUT) else 1)
        if standalone_mode:
            sys.exit(code)
        return code


def fail(prog: str, message: str, code: int) -> int:
    first = " ".join(message.split())
    click.echo(f"{prog}: error: {safe(first)}", err=True)
    return code


def _version() -> str:
    from tnt_snapshot_plugin import __version__

    return __version__


@click.group(name="tnt-snapshot", cls=_Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="tnt-snapshot", message="%(prog)s %(version)s")
def cli() -> None:
    """Look at tnt_snapshot_plugin snapshot directories: local paths, file:// or s3:// URLs."""


def main(argv: Optional[list[str]] = None) -> int:
    """The console script ``tnt-snapshot``."""
    return int(cli.main(argv, prog_name="tnt-snapshot", standalone_mode=False))


if __name__ == "__main__":
    sys.exit(main())
