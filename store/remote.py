"""A store's folder at a URL (`s3://bucket/prefix`, or any other fsspec scheme): open it, list it, move files.

fsspec (+ s3fs for `s3://`) does the protocol work: signing, multipart uploads, retries. What is ours is only the
store's commit protocol on top (store/remote_push.py, store/remote_pull.py) and turning the libraries' exceptions into one line a user
can act on. Configuration is the standard AWS environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, `AWS_ENDPOINT_URL` for an S3-compatible server, `AWS_PROFILE`), which botocore reads
itself, or fsspec storage options passed by the caller.
"""

from __future__ import annotations

import base64
import errno
import inspect
import os
import secrets
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from schemas import interruptible
from schemas.errors import UserError
from store import remote_download, remote_endpoint, remote_local, remote_upload
from store.checksum import RunningCrc, SealError, unseal

# user metadata recorded on every object we upload to S3: a rerun can tell an object is already there (same size,
# same CRC32C as the store's checksums.json) from one HEAD request, without reading it back
CRC_META = "crc32c"
CLOCK_DIR = ".clock"  # `Remote.now`'s probe objects (each removed at once)
TRANSFERS = 16  # objects moved at once by push, pull and a lazy open
# What an S3 upload holds in memory: s3fs sends a file under 2 parts in one PUT read whole into memory, and a larger
# one in parts of 50 MiB, 10 at once (~500 MiB per file), so 16 uploads of 256 MB shards held GBs. Ours: parts of
# PART, PARTS_AT_ONCE at once per file, and every upload of the process reserves the bytes it will hold from one
# budget of IN_FLIGHT (small objects - the ~20k shard indexes - still go 16 at a time; big ones wait their turn).
PART = 16 * 2**20  # S3's minimum part is 5 MiB
PARTS_AT_ONCE = 4
# a download (pull, verify URL) is one streamed GET read READ_PIECE at a time (store/remote_download.py): s3fs's
# file object held an 8 MiB block, the piece and copies (~15 MiB a transfer, bench/store_transfer_memory.py)
READ_PIECE = 2**20
IN_FLIGHT = 128 * 2**20  # of file bytes (held as reserved: store/remote_upload._read_body)
# s3fs's own loop of tries around each request (its default 5), on top of botocore's (AWS_MAX_ATTEMPTS, default 5):
# against a server that accepts and never answers, every try waits s3fs's read timeout (15 s), so 25 tries were over
# 6 minutes of silence per request before the one line. Twice still retries what botocore does not (a body cut off
# while s3fs reads it, a garbled throttling answer); `-o retries=N` sets it.
S3FS_TRIES = 2


def each_at_once(fn: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
    """fn(item) for every item, `TRANSFERS` at a time, results in order. A version holds one small object per
    shard (its index; ~20k at 1M samples), each one round trip: one after the other, the latency is the whole
    cost. Threads: fsspec's calls into its event loop are thread-safe.

    Items start in order; once one fails, no later one starts, the running ones finish, and the first failure in
    order is raised. An interrupt (Ctrl-C, whichever thread Linux gave it to) or a caller that stops early does not
    wait for the running ones: they are daemon threads, dropped when the process ends (nothing a transfer leaves
    half done is ever committed).
    Written here because concurrent.futures joins its workers at interpreter exit: a Ctrl-C during a push waited
    for up to 16 large uploads, and `pool.map` went on through every queued item after a failure."""
    items = list(items)
    results: dict[int, tuple[bool, Any]] = {}
    state = {"next": 0, "stop": False}
    cond = threading.Condition()

    def work() -> None:
        while True:
            with cond:
                i = state["next"]
                if state["stop"] or i >= len(items):
                    return
                state["next"] = i + 1
            try:
                got = (True, fn(items[i]))
            except BaseException as e:  # handed to the caller in order
                got = (False, e)
            with cond:
                results[i] = got
                state["stop"] = state["stop"] or not got[0]
                cond.notify_all()

    workers = [threading.Thread(target=work, name="transfer", daemon=True)
               for _ in range(min(TRANSFERS, len(items)))]
    for t in workers:
        t.start()
    try:
        for i in range(len(items)):
            with cond:  # every item before a failure was started: none is waited for in vain
                interruptible.wait_until(cond, lambda: i in results)  # a Ctrl-C taken by a transfer thread ends it
                ok, got = results.pop(i)
            if not ok:
                raise got
            yield got
    except Exception:
        with cond:
            state["stop"] = True
        for t in workers:  # an error: the running transfers finish (and clean up) before it is raised
            interruptible.join(t)
        raise
    finally:
        with cond:
            state["stop"] = True


class ByteBudget:
    """Bytes the transfers of this process may hold in memory at once: `holding(n)` waits until n more fit (one
    transfer alone always may, whatever its size). threading.Semaphore counts units one at a time; this takes n."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held, self.peak = limit, 0, 0
        self._cond = threading.Condition()

    @contextmanager
    def holding(self, n: int) -> Iterator[None]:
        with self._cond:
            while self.held and self.held + n > self.limit:
                self._cond.wait()
            self.held += n
            self.peak = max(self.peak, self.held)
        try:
            yield
        finally:
            with self._cond:
                self.held -= n
                self._cond.notify_all()


uploads_budget = ByteBudget(IN_FLIGHT)


def upload_memory(size: int) -> int:
    """Bytes s3fs holds while uploading a file of `size` bytes with our part size (see PART)."""
    # the part size of a file over 10,000 parts of PART (~156 GiB) is larger: reserved as sent
    return size if size < 2 * PART else min(size, remote_upload.part_size(size, PART) * PARTS_AT_ONCE)


class SharedBar:
    """A tqdm bar that several transfer threads update (tqdm's own counter is not thread-safe)."""

    def __init__(self, bar: Any) -> None:
        self.bar, self._lock = bar, threading.Lock()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.bar.update(n)


def is_url(path: str | Path) -> bool:
    """A URL (`scheme://...`: a store, a source tar or parquet file), not a local path."""
    return "://" in str(path)


# store URL -> where its credentials come from, as the error lines name it: set by `open_remote` where the caller's
# storage options (`-o key=...`) hold them (then the AWS_* variables are not used, and telling the user to check
# them sent them after the wrong thing); a URL not listed uses the environment's.
_credentials_from: dict[str, str] = {}
_CREDENTIAL_OPTIONS = ("key", "secret", "token")  # s3fs's names


def _options_credentials(storage_options: dict[str, Any] | None) -> str | None:
    """The credentials the storage options name, as a user would check them (no value but a profile's name)."""
    opts = storage_options or {}
    if given := [k for k in _CREDENTIAL_OPTIONS if k in opts]:
        return " / ".join(f"-o {k}=..." for k in given) + " (given to the command: the AWS_* variables are not used)"
    if "profile" in opts:
        return f"the AWS profile -o profile={opts['profile']} (~/.aws/credentials)"
    if opts.get("anon"):
        return "-o anon=true (anonymous: no credentials are sent; drop it to use them)"
    return None


def _credentials_hint(url: str) -> str:
    """Where to look when the server refused or found no credentials for `url`: what was actually used."""
    given = _credentials_from.get(url.rstrip("/"))
    if given is not None:
        return given
    if os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
    if os.environ.get("AWS_PROFILE"):
        return f"the AWS profile AWS_PROFILE={os.environ['AWS_PROFILE']} (~/.aws/credentials)"
    return "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"


def _hint(url: str, source: bool = False) -> str:
    # AWS_ENDPOINT_URL points s3:// only: for an http(s) URL the URL itself names the server
    return (("check AWS_ENDPOINT_URL (an S3-compatible server), the network, and that the server runs; "
             if url.startswith("s3://") else "check the network and that the server runs; ")
            + ("then rerun (samples already written are kept)" if source else
               "rerun to continue (what was transferred already is not transferred again)"))


@contextmanager
def remote_errors(url: str, action: str, missing: str | None = None) -> Iterator[None]:
    """The libraries' errors as one UserError line: what failed, on which URL, what to do. `missing`: what to
    do when the object does not exist (a source URL: fix it), where a store's objects vanish only meanwhile."""
    try:
        yield
    except UserError:
        raise
    except OSError as e:
        if e.filename or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):  # local: the CLI's handler says
            raise
        if (line := _cause_line(e, url, action, source=missing is not None)) is not None:
            raise UserError(line) from None
        # an answer that is no S3 server's (not a denial, not a lost connection): its HTML read as S3 says nothing true
        if not isinstance(e, PermissionError) and not _is_transport_error(e) and \
                (line := remote_endpoint.not_s3(url)) is not None:
            raise UserError(f"{action}: {line}") from None
        if missing and isinstance(e, FileNotFoundError) and not no_bucket(e):
            raise UserError(f"{action}: {url} does not exist ({_first_line(e)}); {missing}") from None
        _remote_os_error(e, url, action, source=missing is not None)
    except Exception as e:  # noqa: BLE001  connection refused/reset, timeouts: botocore's and aiohttp's own types
        if (line := _cause_line(e, url, action, source=missing is not None)) is not None:
            raise UserError(line) from None
        if _is_credentials_error(e):
            given = _credentials_from.get(url.rstrip("/"))
            raise UserError(f"{action}: no credentials for {url} ({type(e).__name__}: {_first_line(e)}); "
                            + (f"check {given}" if given is not None else
                               "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")) from None
        if _is_endpoint_error(e):
            given = os.environ.get("AWS_ENDPOINT_URL")
            raise UserError(f"{action}: the endpoint of {url} is not a valid URL ({_first_line(e)}); check "
                            + (f"AWS_ENDPOINT_URL ({given!r}) or " if given is not None else "")
                            + "-o endpoint_url=...: a URL with its scheme, e.g. http://127.0.0.1:9000") from None
        if _is_transport_error(e):
            raise UserError(f"{action}: lost the connection to {url} ({type(e).__name__}: {_first_line(e)}); "
                            + _hint(url, source=missing is not None)) from None
        if _is_aws_config_error(e):
            raise UserError(f"{action}: the AWS configuration for {url} is unusable ({type(e).__name__}: "
                            f"{_first_line(e)}); check {_config_hint(url)}") from None
        if (bad := _bad_config_value(e)) is not None:
            raise UserError(f"{action}: the AWS configuration for {url} is unusable ({bad}); check "
                            f"{_config_hint(url)}") from None
        raise


def _remote_os_error(e: OSError, url: str, action: str, source: bool = False) -> None:
    """s3fs reports the server's answers as OSError subclasses (no file name)."""
    if isinstance(e, PermissionError):
        raise UserError(f"{action}: access to {url} denied ({_first_line(e)}); check {_credentials_hint(url)} "
                        "and the bucket's permissions") from None
    if isinstance(e, FileNotFoundError):
        if no_bucket(e):
            raise UserError(f"{action}: the bucket of {url} does not exist ({_first_line(e)}); create it or "
                            "fix the URL") from None
        raise UserError(f"{action}: {url}: {_first_line(e)} (an object disappeared meanwhile?); rerun") from None
    if _is_transport_error(e):
        raise UserError(f"{action}: lost the connection to {url} ({type(e).__name__}: {_first_line(e)}); "
                        + _hint(url, source)) from None
    raise UserError(f"{action}: {url} answered: {_first_line(e)}; rerun, or check the server") from None


def unreachable(e: BaseException | None) -> BaseException | None:
    """The connection refused, lost or timed out: `e` itself or an error of its cause chain; None for any other
    error. fsspec's http answers FileNotFoundError(url) for a server it could not reach at all (its info's HEAD and
    GET both failed), aiohttp's connection error its cause: the one test of `remote_errors` and of the resize
    stage's KnownTars.still, which must not take a server that is down for an object gone or put again."""
    while e is not None and not _is_transport_error(e):
        e = e.__cause__
    return e


def http_answer(e: BaseException | None) -> Any:
    """The HTTP server's answer other than not found (401, 403, 5xx: aiohttp's ClientResponseError) that `e` is or
    has in its cause chain, else None: fsspec's http info raises FileNotFoundError(url) from its GET's answer, whatever
    its status, and its reads raise that answer itself."""
    while e is not None:
        status = getattr(e, "status", None)
        if isinstance(status, int) and any(c.__name__ == "ClientResponseError" for c in type(e).__mro__):
            return None if status in (404, 410) else e
        e = e.__cause__
    return None


def _cause_line(e: BaseException, url: str, action: str, source: bool) -> str | None:
    """The line for an error whose cause says what it is (`unreachable`, `http_answer`), where `e`'s own type would
    say "does not exist; fix the URL" (a server that is down, a 403 from an expired signed URL, a 503); None for the
    rest, `e` itself a lost connection included (the caller's line says so)."""
    if (lost := unreachable(e)) is not None and lost is not e:
        return (f"{action}: the server of {url} could not be reached ({type(lost).__name__}: {_first_line(lost)}); "
                + _hint(url, source))
    if (answer := http_answer(e)) is None:
        return None
    said = f"{answer.status} {answer.message}".strip()
    if answer.status in (401, 403):
        return (f"{action}: access to {url} denied (HTTP {said}); check that the URL may be read (a signed URL that "
                "expired, the server's access rules), then rerun")
    return f"{action}: {url} answered HTTP {said}; rerun, or check the server"


def no_bucket(e: BaseException) -> bool:
    """Is this not-found the bucket's (S3's NoSuchBucket), not an object's? By the server's words, never by
    "bucket" anywhere in the text: a missing object's error is its path, and bucket names often hold "bucket"."""
    text = str(e).lower()
    return "specified bucket" in text or "nosuchbucket" in text


def lost_object(remote: "Remote", rel: str, e: FileNotFoundError) -> UserError | None:
    """The line for object `rel` of a version (`<table>/v<N>/<name>`, listed by its checksums.json) that is not
    there while the version's manifest is, or while store.json names the version current (`lost_version`): deleted
    behind the tool's back, where `remote_errors`' "rerun" (right for an object gone with its version: a gc deletes
    the manifest first, of versions no longer current) would fail the same way for ever. None when the bucket went
    away or the version went with a gc. Pull, the lazy open and the lazy reader all say it."""
    from store import format as fmt

    if no_bucket(e):
        return None
    version_rel = rel.rsplit("/", 1)[0]
    if not remote.exists(f"{version_rel}/{fmt.MANIFEST}"):
        table, name = version_rel.rsplit("/", 1)
        return lost_version(remote, table, int(name[1:]))
    if rel.endswith("/" + fmt.CHECKSUMS):
        return UserError(f"{remote.url}/{rel} is missing (its version's manifest is there); refused: push that "
                         "version again from an intact store")
    return UserError(f"{remote.url}/{rel} is missing (its version's {fmt.CHECKSUMS} lists it); refused: push that "
                     f"version again from an intact store, or `pipeline store repair {remote.url}`")


def lost_version(remote: "Remote", table: str, version: int) -> UserError | None:
    """The line for a version without its manifest that the remote's store.json still names current: deleted behind
    the tool's back (an `aws s3 rm`, a lifecycle rule; `store gc` never removes a current version), where "rerun"
    failed alike for ever. None when its manifest is there (committed since a listing), or store.json names another
    version now or cannot be read (a push moved on, and a gc removed this one: a rerun reads the new one)."""
    from store import format as fmt

    if remote.exists(f"{table}/v{version}/{fmt.MANIFEST}"):
        return None
    try:
        current = int(unseal(remote.read(fmt.STORE_JSON, small=True))["tables"][table]["current"])
    except (FileNotFoundError, SealError, ValueError, KeyError, TypeError):
        return None
    if current != version:
        return None
    return UserError(f"{remote.url}/{table}/v{version} is gone (no {fmt.MANIFEST}) while {fmt.STORE_JSON} names it "
                     "current: deleted behind the tool's back (`store gc` never removes a current version); "
                     f"refused: push that version again from a store that holds it (`pipeline store push STORE "
                     f"{remote.url}`)")


def _is_credentials_error(e: BaseException) -> bool:
    # botocore's NoCredentialsError / PartialCredentialsError (by name: botocore is imported only with s3fs)
    return any(c.__name__ in ("NoCredentialsError", "PartialCredentialsError") for c in type(e).__mro__)


# botocore's refusals of the AWS configuration it reads before any request (by name, as above; subclasses count)
_AWS_CONFIG_ERRORS = frozenset((
    "ProfileNotFound", "ConfigNotFound", "ConfigParseError", "InvalidConfigError", "InvalidRetryConfigurationError",
    "NoRegionError", "CredentialRetrievalError", "TokenRetrievalError", "SSOError", "UnknownCredentialError",
    "InvalidS3AddressingStyleError", "InvalidProxiesConfigError"))


def _is_aws_config_error(e: BaseException) -> bool:
    """AWS_PROFILE or `-o profile=` naming a profile that ~/.aws/config and ~/.aws/credentials lack (a node set up
    without it), a malformed config file, an expired SSO login, a failing credential_process: botocore's traceback
    of a dozen frames before, on every command."""
    return any(c.__name__ in _AWS_CONFIG_ERRORS for c in type(e).__mro__)


def _bad_config_value(e: BaseException) -> str | None:
    """What botocore's conversion of a configured value (AWS_MAX_ATTEMPTS=abc, `max_attempts = abc` in
    ~/.aws/config) refused: a bare ValueError raised in its config provider, told from any other ValueError by
    where it was raised, never caught by type alone. Names the AWS_* variable holding that value when one does."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if not isinstance(e, ValueError) or tb is None or \
            not tb.tb_frame.f_code.co_filename.endswith(os.path.join("botocore", "configprovider.py")):
        return None
    named = sorted(k for k, v in os.environ.items() if k.startswith("AWS_") and v and str(e).endswith(repr(v)))
    return (f"{', '.join(f'{k}={os.environ[k]!r}' for k in named)} is not a valid value: {_first_line(e)}" if named
            else f"a setting of the AWS config file is not a valid value: {_first_line(e)}")


def _config_hint(url: str) -> str:
    """Where that configuration comes from: the profile named (by `-o profile=` or AWS_PROFILE), else the files."""
    given = _credentials_from.get(url.rstrip("/"))
    if given is not None and "profile" in given:
        return f"{given} and AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/config, ~/.aws/credentials)"
    named = f"AWS_PROFILE={os.environ['AWS_PROFILE']}, " if os.environ.get("AWS_PROFILE") else ""
    return (f"{named}AWS_CONFIG_FILE / AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/config, ~/.aws/credentials) "
            "and the other AWS_* variables on this node")


def _is_endpoint_error(e: BaseException) -> bool:
    """botocore's refusal of a malformed endpoint URL (no scheme: a ValueError; a stray space: its own type)."""
    return (isinstance(e, ValueError) and str(e).startswith("Invalid endpoint")) or any(
        c.__name__ == "EndpointResolutionError" for c in type(e).__mro__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def is_transport_error(e: BaseException) -> bool:
    """A lost connection, a timeout (botocore's, aiohttp's or the OS's types), not an answer of the server."""
    return _is_transport_error(e)


def _is_transport_error(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    kinds: list[type] = []
    try:  # a body cut off mid-transfer reaches us as aiohttp's own error once s3fs's retries are spent
        from aiohttp import ClientConnectionError, ClientPayloadError

        kinds += [ClientConnectionError, ClientPayloadError]
    except ImportError:
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        kinds.append(FSTimeoutError)
    except ImportError:
        pass
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError, IncompleteReadError

        kinds += [BotoConnectionError, HTTPClientError, IncompleteReadError]
        from botocore.exceptions import ResponseStreamingError

        kinds.append(ResponseStreamingError)
    except ImportError:
        pass
    return isinstance(e, tuple(kinds))


@dataclass
class Remote:
    """One store folder at a URL: the fsspec file system and the folder's path on it."""

    url: str
    fs: Any
    root: str
    _skew: float | None = field(default=None, repr=False, compare=False)  # server clock - this machine's

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def now(self) -> float:
        """The server's clock (epoch seconds), what its LastModified times are compared with (a lease's last
        refresh, a push's newest object): this machine's clock may be off by more than gc's margins, and judging
        a live reader's lease stale (or a running push's objects old) would delete data in use. The offset is
        measured once per Remote: a 0-byte probe object written, its LastModified read, removed (whole seconds
        on S3: the offset is within ~1 s). A probe left by a killed command is removed by `store gc`."""
        if self._skew is None:
            rel = f"{CLOCK_DIR}/{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
            before = time.time()
            self.write(rel, b"")  # read-only access: PermissionError (gc --dry-run handles it)
            after = time.time()
            try:
                server = _modified(self.fs.info(self.path(rel)))
            finally:
                self.delete([rel])
            self._skew = server - (before + after) / 2
        return time.time() + self._skew

    @property
    def is_local(self) -> bool:
        return remote_local.is_local(self.fs)

    @property
    def is_s3(self) -> bool:
        return bool({"s3", "s3a"} & set(remote_local.protocols(self.fs)))

    def listing(self, under: str = "", prefix: str = "") -> dict[str, int]:
        """{path relative to the store root: size} of every object under it, or under its folder `under` (one
        listing, never cached); `prefix`: only those whose path below that folder starts with it."""
        return {rel: int(info["size"]) for rel, info in self._found(under, prefix).items()}

    def listing_times(self, under: str = "") -> dict[str, tuple[int, float]]:
        """{path relative to the store root: (size, last modified, epoch seconds)} of every object, or of those
        under its folder `under` (one listing; on S3 the time is the server's LastModified: when the object's last
        PUT completed)."""
        return {rel: (int(info["size"]), _modified(info)) for rel, info in self._found(under).items()}

    def _found(self, under: str = "", prefix: str = "") -> dict[str, dict[str, Any]]:
        """{path relative to the store root: fsspec's entry} of the objects under `under` starting with `prefix`.
        A prefix is listed by the server where the back end can (s3fs, gcsfs: a version's ~40k objects at 1M
        samples are ~40 listing requests, a rank's own few hundred one); a local folder's names are read and only
        the matching ones stat'ed; elsewhere the folder is listed and filtered here."""
        self.fs.invalidate_cache()
        folder = self.path(under) if under else self.root
        try:
            if not prefix:
                found = self.fs.find(folder, detail=True)
            elif "prefix" in inspect.signature(self.fs.find).parameters:
                found = self.fs.find(folder, detail=True, prefix=prefix)
            elif self.is_local:
                found = remote_local.find(folder, prefix)
            else:
                found = self.fs.find(folder, detail=True)
        except FileNotFoundError as e:
            if no_bucket(e):
                raise
            return {}
        root = self.root.rstrip("/") + "/"
        start = folder.rstrip("/") + "/" + prefix if prefix else root  # what any back end returned is held to it
        return {name[len(root):]: info for name, info in found.items()
                if name.startswith(start) and info.get("type") != "directory"}

    def delete(self, rels: list[str]) -> None:
        """Remove these objects (one batched request on S3); one already gone is not an error."""
        if rels:
            try:
                self.fs.rm([self.path(r) for r in rels])
            except FileNotFoundError:
                pass

    def read(self, rel: str, small: bool = False) -> bytes:
        """The whole object; read again once when it arrived other than the server's checksum of it (botocore's
        FlexibleChecksumError: damaged on the way), then refused in one line naming it (damaged on the server).
        `small`: one GET on S3 (s3fs from 2026.3 first asks the size, a HEAD - and a listing when there is no such
        object - to split a large object into parallel reads; an earlier one takes no `max_concurrency` and reads
        with one GET anyway)."""
        one_get = {"max_concurrency": 1} if small and self._cat_takes_concurrency() else {}
        for attempt in range(2):
            try:
                return self.fs.cat_file(self.path(rel), **one_get)
            except Exception as e:  # noqa: BLE001
                if not remote_download.differs_from_server_checksum(e):
                    raise
                if attempt:
                    raise UserError(f"{self.url}/{rel} is damaged: read twice, its bytes differ from the server's own "
                                    f"checksum of it ({_first_line(e)}); push it again from an intact store, or "
                                    f"`pipeline store repair {self.url}`") from None
        raise AssertionError("not reached")

    def _cat_takes_concurrency(self) -> bool:
        """Does this S3 back end's whole-object read take `max_concurrency` (s3fs 2026.3 on)?"""
        return self.is_s3 and "max_concurrency" in inspect.signature(self.fs._cat_file).parameters

    def write(self, rel: str, data: bytes, crc: str | None = None) -> None:
        if self.is_local:
            remote_local.write(self.root, self.path(rel), data)
            return
        self.fs.pipe_file(self.path(rel), data, **self._meta(crc))

    def recorded_crc(self, rel: str) -> str | None:
        """The CRC32C recorded with the object at upload (S3 user metadata, a file's xattr); else computed from its
        bytes: on S3 too, for an object another tool uploaded (`aws s3 sync` of a store: no metadata of ours), which
        was taken for another store's object ("the stores grew apart") by every later push."""
        if self.is_s3:
            return self._s3_crc(rel)
        if self.is_local and (recorded := remote_local.recorded_crc(self.path(rel))) is not None:
            return recorded
        elif not self.is_local and (native := native_crc32c(self.fs.info(self.path(rel)))) is not None:
            return native  # the server's own CRC32C of the bytes (GCS): a resumed push reads nothing back
        crc = RunningCrc()
        for chunk in remote_download.pieces(self.fs, self.path(rel), READ_PIECE, self.is_s3):  # one streamed GET
            crc.update(chunk)
        return crc.hex()

    def _s3_crc(self, rel: str) -> str:
        """`recorded_crc` on S3: one HEAD (our metadata, else the object's ETag and size); an object without our
        metadata is read once, its CRC32C remembered by its ETag (store/remote_crcs.py): before, every push read it
        back again."""
        from store import remote_crcs

        bucket, key, _ = self.fs.split_path(self.path(rel))
        head = self.fs.call_s3("head_object", Bucket=bucket, Key=key)
        if (recorded := (head.get("Metadata") or {}).get(CRC_META)) is not None:
            return recorded
        # by endpoint, URL, ETag and size: two S3-compatible servers (MinIO, AWS) may each hold an object of that
        # bucket and key, with ETags that agree by chance (a server's own ETag scheme, multipart ones, SSE-KMS)
        where = remote_endpoint.endpoint_of(self.fs) or "aws"
        obj, etag, size = f"{where} s3://{bucket}/{key}", head.get("ETag"), int(head.get("ContentLength", -1))
        if etag and (known := remote_crcs.known(obj, etag, size)) is not None:
            return known
        crc = RunningCrc()
        for chunk in remote_download.pieces(self.fs, self.path(rel), READ_PIECE, True, etag):  # one streamed GET
            crc.update(chunk)
        if etag:
            remote_crcs.remember(obj, etag, size, crc.hex())
        return crc.hex()

    def upload(self, local: Path, rel: str, crc: str, progress, nbytes: int | None = None) -> bool:
        """Upload `local` as `rel` only if no object `rel` exists; False when one does (nothing written).

        Every object of a version is written once: on S3 a conditional PUT (If-None-Match: *) decides on the
        server, so a pusher never overwrites an object another pusher wrote, and of two pushers racing for the
        same version exactly one creates its manifest (the commit). On a local file system `link(2)` decides
        (store/remote_local.py); elsewhere it is a check, then a write.

        `nbytes` given: `local` must still be what its record says (`nbytes` bytes, CRC32C `crc`), checked over
        the very bytes sent (one read of the file on S3 and file://); otherwise `remote_upload.Mismatch` is raised
        and nothing is visible under `rel` (store/remote_upload.py)."""
        expect = None if nbytes is None else (nbytes, crc)
        if self.is_local:
            return remote_local.create(self.root, local, self.path(rel), progress, crc, expect)
        size = local.stat().st_size
        if not self.is_s3:  # the back end's buffered writer holds up to a block of PART, our read as much
            with uploads_budget.holding(min(size, 2 * PART)):
                return remote_upload.generic_create(self.fs, self.path(rel), local, progress, expect, PART)
        with uploads_budget.holding(upload_memory(size)):
            return remote_upload.s3_create(self.fs, self.path(rel), local, progress, self._meta(crc), expect,
                                           PART, PARTS_AT_ONCE)

    def exists(self, rel: str) -> bool:
        """Is object `rel` there (one request, no listing: on S3 a HEAD)?"""
        if self.is_s3:
            bucket, key, _ = self.fs.split_path(self.path(rel))
            return remote_upload.object_there(self.fs, bucket, key)
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self.path(rel)))

    def has(self, rel: str, nbytes: int, crc: str, listing: dict[str, int] | None = None) -> bool:
        """Is object `rel` there with this size and CRC32C? (`listing`: sizes already listed, saves a request)"""
        if listing is not None:
            size = listing.get(rel)
        else:
            try:
                self.fs.invalidate_cache()
                size = int(self.fs.info(self.path(rel))["size"])
            except FileNotFoundError:
                return False
        try:
            return size == nbytes and self.recorded_crc(rel) == crc
        except FileNotFoundError:  # listed, then removed (a gc of a killed push's leftovers): not there
            return False

    def download(self, rel: str, local: Path, progress) -> str:
        """Fetch one object to `local`; its CRC32C (computed from the bytes written, no re-read)."""
        crc = RunningCrc()
        with open(local, "wb") as dst:  # one streamed GET, a piece at a time (store/remote_download.py)
            for chunk in remote_download.pieces(self.fs, self.path(rel), READ_PIECE, self.is_s3):
                dst.write(chunk)
                crc.update(chunk)
                progress.update(len(chunk))
        return crc.hex()

    def swap(self, rel: str, update: Callable[[bytes | None], bytes | None], attempts: int = 8) -> None:
        """Compare-and-swap of a small object (store.json, quarantine.parquet): `update(old bytes or None)` -> new
        bytes (None: leave it as it is), written only if the object is still what was read (S3: If-Match on its
        ETag / If-None-Match when absent); on a lost race it reads again and retries, so two writers never drop
        each other's update. On a local file system the read-modify-write holds a flock instead."""
        if self.is_local:
            with remote_local.exclusive(self.root, rel):
                try:
                    old = self.read(rel, small=True)
                except FileNotFoundError:
                    old = None
                if (new := update(old)) is not None:
                    self.write(rel, new)
            return
        for attempt in range(attempts):
            self.fs.invalidate_cache()
            try:
                etag = self.fs.info(self.path(rel)).get("ETag")
                old = self.read(rel, small=True)
            except FileNotFoundError:
                etag, old = None, None
            new = update(old)
            if new is None:  # nothing to change
                return
            if not self.is_s3:
                self.write(rel, new)
                return
            cond = {"IfMatch": etag} if etag else {"mode": "create"}
            try:
                self.fs.pipe_file(self.path(rel), new, **cond)
                return
            except FileExistsError:
                continue
            except OSError as e:  # lost the race (412), or raced it (409 ConditionalRequestConflict): read again
                if remote_upload.is_conflict(e):  # a write still in flight: at once it would meet it again
                    remote_upload.backoff(attempt)
                elif not remote_upload.precondition_failed(e):
                    raise
        raise UserError(f"{self.url}/{rel}: changed by another writer {attempts} times in a row while this one "
                        "tried to update it; rerun")

    def _meta(self, crc: str | None) -> dict[str, Any]:
        return {"Metadata": {CRC_META: crc}} if self.is_s3 and crc else {}


def native_crc32c(info: dict[str, Any]) -> str | None:
    """The CRC32C a back end computes itself, as fsspec's listing entry carries it: GCS (gcsfs) gives every object's
    `crc32c`, base64 of its 4 big-endian bytes (the same Castagnoli CRC as ours, composite objects included). None
    where there is none."""
    value = info.get("crc32c")
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return f"{int.from_bytes(raw, 'big'):08x}" if len(raw) == 4 else None


def _modified(info: dict[str, Any]) -> float:
    """An fsspec listing entry's modification time as epoch seconds (S3: LastModified; local: mtime)."""
    when = info.get("LastModified", info.get("mtime", info.get("last_modified", info.get("created", 0.0))))
    return when.timestamp() if hasattr(when, "timestamp") else float(when or 0.0)


def open_remote(url: str, storage_options: dict[str, Any] | None = None) -> Remote:
    """The store folder at `url`; UserError when the scheme's library is missing."""
    try:
        import fsspec
    except ImportError:
        raise UserError(f"{url}: a store at a URL needs fsspec: pip install 'qwen-edit-lora-pipeline[s3]'") from None
    from store import s3_models

    s3_models.share()  # a fresh client per open, not a fresh parse of S3's model JSON (0.3-0.5 s of CPU each)
    try:
        # a fresh instance each time: a cached one may hold a session to a server that has since restarted
        fs, root = fsspec.url_to_fs(url, skip_instance_cache=True, **(storage_options or {}))
    except ImportError as e:
        raise UserError(f"{url}: this scheme needs a package that is not installed ({_first_line(e)}); for "
                        "s3:// install the s3 extra: pip install 'qwen-edit-lora-pipeline[s3]'") from None
    except ValueError as e:
        raise UserError(f"{url}: not a store URL this program can open ({_first_line(e)})") from None
    # read-only to fsspec (no put, no listing a store needs); its root is the whole URL, so the empty-folder
    # check below misread the scheme's own "//"
    if set(remote_local.protocols(fs)) & {"http", "https"}:
        raise UserError(f"{url}: a store cannot live at an http(s) URL (it cannot be written or listed there); pass "
                        "s3://bucket/prefix (AWS_ENDPOINT_URL=http://... for an S3-compatible server) or a folder")
    root = root.rstrip("/")
    if not root:
        raise UserError(f"{url}: no bucket or folder in the URL; pass s3://bucket/prefix")
    if (given := _options_credentials(storage_options)) is not None:
        _credentials_from[url.rstrip("/")] = given
    else:  # a later open of the URL without options uses the environment's
        _credentials_from.pop(url.rstrip("/"), None)
    if "//" in root and not remote_local.is_local(fs):
        # an empty folder name: objects were written under keys the listings never show back (a push "succeeded"
        # into a store no pull, verify or later push could find)
        fixed = url.split("://", 1)[0] + "://" + "/".join(p for p in root.split("/") if p)
        raise UserError(f"{url}: an empty folder name (//) in the URL; write it without: {fixed}")
    remote_endpoint.remember(url, fs, root)
    remote = Remote(url, fs, root)
    if remote.is_s3 and "retries" not in (storage_options or {}):
        fs.retries = S3FS_TRIES
    return remote
