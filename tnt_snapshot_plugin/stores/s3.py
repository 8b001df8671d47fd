"""Snapshot directories on S3 (and S3-compatible object stores): :class:`S3Store`, its boto3
client, the translation of botocore's errors into the plugin's, and the dirpath lease.

Object stores cannot rename atomically: a snapshot is written under its final name and published
by ``.snapshot_metadata`` written last (:class:`~.base.MetadataWrittenLast`). boto3 is imported
only when an S3 store or client is built; a missing boto3 is a ConfigError with the install hint.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

from tnt_snapshot_plugin.config import DEFAULT_STORAGE_TIMEOUT_S
from tnt_snapshot_plugin.errors import (
    ConfigError,
    LockWarning,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    SnapshotWriteError,
    StorageUnavailableError,
)
from tnt_snapshot_plugin.stores.base import (
    LEASE_FNAME,
    WRITER_FNAME,
    Buffer,
    DirLock,
    Done,
    Read,
    Store,
    is_missing_key,
)
from tnt_snapshot_plugin.stores.commit import MetadataBytes, MetadataWrittenLast
from tnt_snapshot_plugin.stores.fileio import byte_views
from tnt_snapshot_plugin.stores.ownership import (
    LEASE_S,
    busy_error,
    hold_lost,
    holder_text,
    lease_held_by_another,
)
from tnt_snapshot_plugin.stores.ranged_reads import (
    FETCH_CHUNK_BYTES,
    FETCH_WORKERS,
    fetch_ranges,
    read_ranges,
)

S3_OPTION_KEYS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
    }
)

#: A payload larger than this is uploaded in parts of this size (multipart upload), not one PUT.
MULTIPART_BYTES = 64 * 1024 * 1024

#: botocore's loader of its own data files (the S3 service model, the endpoint rules), the one
#: thing the stores' clients share: read-only data botocore ships, loaded once per process, so
#: that building a store's client does not parse the service model again. No client, session,
#: credential or connection is shared: each store builds its own.
_data_loader: Optional[Any] = None
_data_loader_lock = threading.Lock()


@dataclass(frozen=True)
class S3Hints:
    """How the caller gives an S3 connection its settings, as the hints of S3 errors name them:
    the saver's and restore's callers pass ``storage_options``; the command line has options and
    environment variables of its own (``tnt_snapshot_plugin.cli``)."""

    #: where the endpoint comes from
    endpoint: str
    #: where the region comes from
    region: str
    #: where the credentials come from
    credentials: str


#: The hints for callers of the library: ``storage_options``' keys.
STORAGE_OPTIONS_HINTS = S3Hints(
    endpoint="storage_options (endpoint_url)",
    region="storage_options (region_name)",
    credentials="storage_options (aws_access_key_id, aws_secret_access_key, aws_session_token)",
)

_hints: contextvars.ContextVar[S3Hints] = contextvars.ContextVar("tnt_snapshot_plugin_s3_hints", default=STORAGE_OPTIONS_HINTS)


@contextlib.contextmanager
def hints_for(hints: S3Hints) -> Iterator[None]:
    """S3 stores and clients built inside this block name their settings as ``hints`` does in the
    errors they raise (a store keeps the hints it was built with, on every thread)."""
    token = _hints.set(hints)
    try:
        yield
    finally:
        _hints.reset(token)


def current_hints() -> S3Hints:
    """The hints of S3 stores built now (:func:`hints_for`; else :data:`STORAGE_OPTIONS_HINTS`)."""
    return _hints.get()


def s3_client(storage_options: Optional[dict[str, Any]], timeout_s: float = DEFAULT_STORAGE_TIMEOUT_S) -> Any:
    """A new boto3 S3 client for ``storage_options`` (the ``AWS_*`` environment fills in what
    they leave out), each of whose requests (retries and their backoff included) gives up within
    ``timeout_s`` (:func:`request_limits`); a store builds one and its nested stores use it. An
    endpoint or region boto3 refuses is a ConfigError naming where it came from
    (:func:`current_hints`)."""
    try:
        import boto3
    except ImportError:
        raise ConfigError(
            "s3:// snapshots need boto3: pip install 'tnt-snapshot-plugin[s3]'"
        ) from None
    options = dict(storage_options or {})
    unknown = set(options) - S3_OPTION_KEYS
    if unknown:
        raise ConfigError(
            f"storage_options has keys {sorted(unknown)} that the S3 storage does not know; "
            f"expected some of {sorted(S3_OPTION_KEYS)}"
        )
    try:
        return boto3.session.Session(botocore_session=_botocore_session()).client(
            "s3", config=_s3_config(timeout_s), **options
        )
    except Exception as exc:
        mapped = _client_error(exc)
        if mapped is None:
            raise
        raise mapped from exc


def _botocore_session() -> Any:
    """A new botocore session whose data loader is the process's (:data:`_data_loader`)."""
    import botocore.session

    global _data_loader
    session = botocore.session.get_session()
    with _data_loader_lock:
        if _data_loader is None:
            _data_loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _data_loader)
    return session


def _client_error(exc: BaseException) -> Optional[ConfigError]:
    """The ConfigError for boto3 refusing to build a client (an endpoint that is not a URL, a
    region name of the wrong form), or None."""
    from botocore.exceptions import BotoCoreError, InvalidRegionError

    hints = current_hints()
    if isinstance(exc, InvalidRegionError):
        return ConfigError(f"the S3 region is not valid ({exc}); check {hints.region}")
    if isinstance(exc, BotoCoreError):
        return ConfigError(f"the S3 client cannot be built ({type(exc).__name__}: {exc})")
    if isinstance(exc, ValueError):  # botocore's own checks of the endpoint URL
        return ConfigError(f"the S3 endpoint is not a URL boto3 takes ({exc}); check {hints.endpoint}")
    return None


def _s3_config(timeout_s: float) -> Any:
    """botocore's configuration: see :func:`request_limits`."""
    from botocore.config import Config

    attempts, connect, read = request_limits(timeout_s)
    retries: dict[str, Any] = {
        "mode": os.environ.get("AWS_RETRY_MODE", "standard"),
        "total_max_attempts": attempts,
    }
    return Config(retries=retries, connect_timeout=connect, read_timeout=read)


#: The most attempts a request gets (``AWS_MAX_ATTEMPTS`` may say otherwise).
MAX_ATTEMPTS = 4
#: The least time an attempt gets (connect and read together) while it can be retried: a bound
#: too small for that many attempts of this length gets fewer attempts.
MIN_ATTEMPT_S = 2.0
#: The longest a connection is given (the rest of an attempt's time goes to reading).
MAX_CONNECT_S = 10.0


def _backoff_s(attempts: int) -> float:
    """The longest botocore sleeps between ``attempts`` attempts: up to 2**(i-1) s before
    retry i, capped at 20 s each (its exponential backoff, "standard" and "legacy" alike)."""
    return float(sum(min(2.0 ** (i - 1), 20.0) for i in range(1, attempts)))


def request_limits(timeout_s: float) -> tuple[int, float, float]:
    """(attempts, connect timeout, read timeout) such that one request, every attempt and the
    backoff between them included, gives up within ``timeout_s``: transient errors (a connection
    refused or reset, timeouts, throttling, 5xx) are retried with exponential backoff, up to
    ``MAX_ATTEMPTS`` attempts in all (or ``AWS_MAX_ATTEMPTS``), fewer when ``timeout_s`` leaves
    an attempt under ``MIN_ATTEMPT_S``. An attempt's time is a third for the connection (at most
    ``MAX_CONNECT_S``), the rest for each read (botocore's read timeout bounds the time without a
    byte from the server, not a whole transfer: a large upload that keeps moving is not cut).
    With the default of 60 s: 4 attempts, 4.4 s to connect, 8.8 s to read."""
    try:
        attempts = max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", MAX_ATTEMPTS)))
    except ValueError:
        attempts = MAX_ATTEMPTS
    while attempts > 1 and (timeout_s - _backoff_s(attempts)) / attempts < MIN_ATTEMPT_S:
        attempts -= 1
    attempt_s = (timeout_s - _backoff_s(attempts)) / attempts
    connect = min(MAX_CONNECT_S, attempt_s / 3)
    return attempts, connect, attempt_s - connect


_CREDENTIAL_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403", "InvalidToken"}
)


def s3_error(url: str, exc: BaseException, hints: S3Hints = STORAGE_OPTIONS_HINTS) -> Optional[SnapshotError]:
    """The plugin's error for a botocore exception met at ``url`` (None: not botocore's), its hint
    naming the settings as ``hints`` does."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            return SnapshotNotFoundError(
                f"{url}: the bucket does not exist ({exc}); check the URL and {hints.endpoint}"
            )
        if code in ("NoSuchKey", "404", "NotFound"):  # a FileNotFoundError, as for local files
            return SnapshotNotFoundError(f"{url}: no such object ({exc})")
        if code in _CREDENTIAL_CODES:
            return ConfigError(
                f"{url}: the object store refused the credentials ({exc}); check {hints.credentials}"
            )
        return StorageUnavailableError(f"{url}: the object store failed the request ({exc})")
    if isinstance(exc, NoCredentialsError):
        return ConfigError(f"{url}: no credentials ({exc}); pass them in {hints.credentials}")
    if isinstance(exc, BotoCoreError):
        return StorageUnavailableError(
            f"{url}: the object store could not be reached ({type(exc).__name__}: {exc}), after "
            f"retries; check {hints.endpoint} and the network"
        )
    return None


@contextlib.contextmanager
def s3_errors(url: str, hints: S3Hints = STORAGE_OPTIONS_HINTS) -> Any:
    """Raise botocore's exceptions as the plugin's (``s3_error``), naming ``url``."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as exc:
        mapped = s3_error(url, exc, hints)
        if mapped is None:
            raise
        raise mapped from exc


def translated(method: Callable[..., Any]) -> Callable[..., Any]:
    """An ``S3Store`` method raising the plugin's errors (``s3_errors``) instead of botocore's."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with s3_errors(self.url, self.hints):
            return method(self, *args, **kwargs)

    return wrapper


class _LeaseChanged(Exception):
    """The lease object is not the version a conditional write expected (another saver wrote it)."""


#: Tries to take the lease when other savers keep writing it between this one's read and write.
_LEASE_TAKE_ATTEMPTS = 5


class S3Lease(DirLock):
    """The live saver's lease on an S3 dirpath: the object ``dirpath/.tnt_snapshot.lease.json``
    names it and when the lease expires (``LEASE_S``); a thread renews it every minute. A second
    saver is refused while an unexpired lease of another run is there, unless that run's process is
    provably dead on this host.

    The lease is written with S3's conditional writes: created with ``If-None-Match: *``, replaced
    and renewed with ``If-Match`` on the version read or last written. Of two savers starting at
    once, one takes it and the other, finding a newer lease than the one it read, looks again and
    is refused. Each write carries a ``generation`` counted by this saver: a renewal refused
    because the lease is not the version it expected reads the lease, and if the lease is this
    run's own (the store applied an earlier write whose answer was lost, and the client's retry of
    it found the new version), takes that version and goes on renewing. A lease of another run
    there (this run's had expired), or none, means the dirpath is lost: a warning, no more
    renewals, and every later snapshot of the run fails (:meth:`check`). An object store that
    refuses conditional writes gets plain ones, with a warning: there, two jobs starting within
    the same second can both miss each other's lease."""

    def __init__(self, store: S3Store, holder: dict[str, Any]) -> None:
        self._store = store
        self._holder = dict(holder)
        self._stop = threading.Event()
        self._etag: Optional[str] = None  # the version of the lease this run last wrote
        self._generation = 0  # of this run's last write attempted
        self._conditional = True
        #: why this run no longer holds dirpath (its lease was taken over or removed), once found
        self._lost: Optional[str] = None
        self._released = False
        try:
            self._take()
        except ConfigError:
            raise  # another live saver holds it
        except Exception as exc:  # best effort: never stop training over the lease
            _lease_warning(store, exc)
        self._thread = threading.Thread(target=self._keep, name="tnt-snapshot-lease", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        for _ in range(_LEASE_TAKE_ATTEMPTS):
            current, etag = self._read()
            if current is not None and self._held_by_another(current):
                raise busy_error(self._store.url, current)
            try:
                self._write(etag)  # create it (no lease read), or replace the version read
                return
            except _LeaseChanged:
                continue  # another saver wrote it meanwhile: look again
        raise ConfigError(
            f"{self._store.url} is being taken by other savers: its lease "
            f"{self._store.child(LEASE_FNAME)} changed {_LEASE_TAKE_ATTEMPTS} times while this one "
            "tried to take it; give each job its own dirpath"
        )

    def _held_by_another(self, lease: dict[str, Any]) -> bool:
        return lease_held_by_another(lease, self._holder.get("run_id"))

    def _read(self) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        """The lease (None if there is none or it is not a JSON object) and its version (ETag)."""
        from botocore.exceptions import ClientError

        store = self._store
        try:
            response = store.client.get_object(Bucket=store.bucket, Key=store._key(LEASE_FNAME))
        except ClientError as exc:
            if is_missing_key(exc):
                return None, None
            raise
        try:
            value = json.loads(response["Body"].read())
        except ValueError:
            value = None
        return (value if isinstance(value, dict) else None), response.get("ETag")

    def _write(self, match: Optional[str]) -> None:
        """Write this run's lease over version ``match`` (None: create it); _LeaseChanged if the
        object is not that version (or, creating, exists; or, replacing, is gone)."""
        from botocore.exceptions import ClientError

        store = self._store
        self._generation += 1
        body = json.dumps(
            {**self._holder, "expires_at": time.time() + LEASE_S, "generation": self._generation}
        ).encode()
        condition = {"IfNoneMatch": "*"} if match is None else {"IfMatch": match}
        try:
            response = store.client.put_object(
                Bucket=store.bucket, Key=store._key(LEASE_FNAME), Body=body,
                **(condition if self._conditional else {}),
            )
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise _LeaseChanged() from exc
            if match is not None and self._conditional and is_missing_key(exc):
                raise _LeaseChanged() from exc  # If-Match on a lease that is gone
            if not (self._conditional and (error.get("Code") == "NotImplemented" or status == 501)):
                raise
            self._conditional = False  # a store without conditional writes: plain ones from now on
            _lease_warning(store, exc, conditional=True)
            response = store.client.put_object(Bucket=store.bucket, Key=store._key(LEASE_FNAME), Body=body)
        self._etag = response.get("ETag")
        if self._etag is None:  # a store that names no versions: nothing to match, plain writes
            self._conditional = False

    def _renew(self) -> None:
        try:
            self._write(self._etag)
            return
        except _LeaseChanged:
            attempted = self._generation
            current, etag = self._read()
        if current is not None and current.get("run_id") == self._holder.get("run_id"):
            # This run's own lease, in a version it did not see written: the store applied a
            # write whose answer was lost, and the client's retry found that new version.
            self._etag = etag
            if current.get("generation") != attempted:
                self._write(etag)  # an earlier write of this run's: renew it now
            return
        lease = self._store.child(LEASE_FNAME)
        if current is None:
            what = f"the lease {lease} of this run was removed during the run (was dirpath removed?)"
        else:
            what = (
                f"the lease {lease} of this run was taken over by another saver "
                f"({holder_text(current)}) after it expired (a stall of over {LEASE_S:.0f} s?)"
            )
        self._lost = hold_lost(what)
        self._stop.set()  # leave it be: no more renewals, and release does not delete it
        import warnings

        warnings.warn(self._lost, LockWarning, stacklevel=2)

    def _keep(self) -> None:
        while not self._stop.wait(min(60.0, LEASE_S / 5)):
            try:
                self._renew()
            except Exception:  # best effort; the next renewal tries again
                pass

    def check(self) -> None:
        if self._lost is not None and not self._released:
            raise SnapshotWriteError(self._lost)

    def release(self) -> None:
        self._released = True
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            current, _ = self._read()
            if current is not None and current.get("run_id") == self._holder.get("run_id"):
                self._store.client.delete_object(
                    Bucket=self._store.bucket, Key=self._store._key(LEASE_FNAME)
                )
        except Exception:  # it expires by itself
            pass


def _lease_warning(store: S3Store, exc: BaseException, conditional: bool = False) -> None:
    import warnings

    if conditional:
        warnings.warn(
            f"the object store of {store.url} refuses conditional writes ({type(exc).__name__}: "
            f"{exc}); the lease {store.child(LEASE_FNAME)} is written without them: two jobs "
            "starting within the same second could both miss each other's lease",
            LockWarning,
            stacklevel=6,
        )
        return
    warnings.warn(
        f"could not read or write the lease {store.child(LEASE_FNAME)} ({type(exc).__name__}: "
        f"{exc}); another job writing {store.url} at the same time would not be detected",
        LockWarning,
        stacklevel=5,
    )


class S3Store(Store):
    protocol = MetadataWrittenLast()
    #: Payloads larger than this go up as a multipart upload in parts of this size.
    multipart_bytes = MULTIPART_BYTES

    def __init__(
        self,
        url: str,
        storage_options: Optional[dict[str, Any]],
        timeout_s: float = DEFAULT_STORAGE_TIMEOUT_S,
        *,
        client: Optional[Any] = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        rest = self.url[len("s3://"):]
        self.bucket, _, self.prefix = rest.partition("/")
        if not self.bucket:
            raise ConfigError(f"dirpath {url!r} names no bucket; expected s3://BUCKET/PREFIX")
        self.storage_options = storage_options
        #: how this store's errors name the S3 settings (those of its builder: :func:`hints_for`)
        self.hints = current_hints()
        #: this store's boto3 client (``client``: its parent store's, for a nested one)
        self.client = client if client is not None else s3_client(storage_options, timeout_s)

    def _key(self, name: str, rel: str = "") -> str:
        parts = [p for p in (self.prefix, name, rel) if p]
        return "/".join(parts)

    def child(self, name: str) -> str:
        return f"{self.url}/{name}"

    def nested(self, name: str) -> Store:
        with hints_for(self.hints):
            return S3Store(self.child(name), self.storage_options, self.timeout_s, client=self.client)


    @translated
    def list_names(self) -> list[str]:
        prefix = self._key("") + "/" if self.prefix else ""
        names: list[str] = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, Delimiter="/"
        ):
            for common in page.get("CommonPrefixes", []):
                names.append(common["Prefix"][len(prefix):].rstrip("/"))
        return names

    def has_file(self, name: str, rel: str) -> bool:
        return self.file_size(name, rel) is not None

    @translated
    def read_file(self, name: str, rel: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(name, rel))["Body"].read()  # type: ignore[no-any-return]

    @translated
    def file_size(self, name: str, rel: str) -> Optional[int]:
        from botocore.exceptions import ClientError

        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(name, rel))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        return int(head["ContentLength"])

    def check_writable(self) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise ConfigError(
                f"dirpath {self.url!r}: bucket {self.bucket!r} is not reachable ({exc}); check "
                "the bucket name and storage_options (endpoint_url, credentials)"
            ) from exc

    def write_payload(
        self, name: str, rel: str, data: Sequence[Buffer], feed: Optional[Callable[[memoryview], Any]] = None
    ) -> None:
        self._check_rel(name, rel, SnapshotWriteError)
        key = self._key(name, rel)
        views = byte_views(data)
        if feed is not None:
            for view in views:
                feed(view)
        total = sum(v.nbytes for v in views)
        with s3_errors(f"s3://{self.bucket}/{key}", self.hints):
            if total <= self.multipart_bytes:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=b"".join(views))
                return
            self._put_multipart(key, views, total)

    def _put_multipart(self, key: str, views: list[memoryview], total: int) -> None:
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = []
            pending = [v for v in views if v.nbytes]
            for number, start in enumerate(range(0, total, self.multipart_bytes), 1):
                want = min(self.multipart_bytes, total - start)
                chunk: list[memoryview] = []
                while want:
                    head = pending[0]
                    take = min(want, head.nbytes)
                    chunk.append(head[:take])
                    want -= take
                    if take == head.nbytes:
                        pending.pop(0)
                    else:
                        pending[0] = head[take:]
                etag = self.client.upload_part(
                    Bucket=self.bucket, Key=key, UploadId=upload, PartNumber=number, Body=b"".join(chunk)
                )["ETag"]
                parts.append({"ETag": etag, "PartNumber": number})
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            raise

    def read_into(
        self, name: str, reads: Sequence[Read], done: Optional[Done] = None, concurrency: Optional[int] = None
    ) -> None:
        """:meth:`Store.read_into` by ranged requests, several at once."""
        self._check_reads(name, reads)
        read_ranges(lambda rel, start, end: self._fetch(name, rel, start, end), reads, done, concurrency)

    def _fetch(self, name: str, rel: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of file ``rel`` of child ``name`` (fewer if the object ends first)."""
        key = self._key(name, rel)
        try:
            with s3_errors(f"s3://{self.bucket}/{key}", self.hints):
                body = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
                try:
                    return body.read()  # type: ignore[no-any-return]
                finally:
                    body.close()
        except SnapshotNotFoundError as exc:
            raise SnapshotCorruptError(
                f"s3://{self.bucket}/{key}: an object the snapshot names is missing; the snapshot is damaged"
            ) from exc
        except StorageUnavailableError as exc:
            code = ""
            cause = exc.__cause__
            response = getattr(cause, "response", None)
            if isinstance(response, dict):
                code = str(response.get("Error", {}).get("Code", ""))
            if code == "InvalidRange":  # the range starts at or past the object's end
                return b""
            raise

    def begin(self, staging: str, writer: dict[str, Any]) -> None:
        with s3_errors(self.child(staging)):
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(staging, WRITER_FNAME), Body=json.dumps(writer).encode()
            )

    @translated
    def commit(
        self, staging: str, final: str, *, metadata_file: str, metadata: MetadataBytes, index_file: str,
        index: bytes, written: dict[str, int],
    ) -> None:
        super().commit(
            staging, final, metadata_file=metadata_file, metadata=metadata, index_file=index_file,
            index=index, written=written,
        )

    def lock(self, holder: dict[str, Any]) -> DirLock:
        return S3Lease(self, holder)

    @translated
    def _delete(self, name: str, unpublish: tuple[str, ...]) -> None:
        # Unpublish first: a crash part-way then leaves an incomplete snapshot (ignored by
        # restore, cleared at the next train start), never a complete-looking one missing files.
        for metadata in unpublish:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name, metadata))
        prefix = self._key(name) + "/"
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})


def open_s3(
    url: str, storage_options: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None
) -> S3Store:
    """The store of an ``s3://BUCKET/PREFIX`` URL (the ``s3`` scheme's opener, stores/registry.py)."""
    if timeout_s is None:
        return S3Store(url, storage_options)
    return S3Store(url, storage_options, timeout_s)


__all__ = ["FETCH_CHUNK_BYTES", "FETCH_WORKERS", "LEASE_S", "STORAGE_OPTIONS_HINTS", "S3Hints", "S3Lease", "S3Store",
           "S3_OPTION_KEYS", "current_hints", "fetch_ranges", "hints_for", "open_s3", "request_limits", "s3_client",
           "s3_error", "s3_errors", "translated"]
