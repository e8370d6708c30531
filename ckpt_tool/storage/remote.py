"""Remote stores (s3://, gs://) and the kvstore specs every root is opened with.

A path or URL becomes a tensorstore kvstore spec here (file, gcs, s3 or
memory driver): the scheme decides whether a root is local or remote, so
the mapping lives with the remote side, and local roots get their file
spec from it too.

Remote stores never hang: tensorstore retries a failed request at most
CKPT_IO_RETRIES times with a short backoff, and every operation ckpt
waits for has a deadline (CKPT_IO_TIMEOUT seconds, plus a second per MiB
moved). The first endpoint that stops answering is remembered; every later
remote operation fails at once with the same one line
(StorageUnavailableError), so a run ends within the deadline instead of
retrying each chunk. Before the first request to an endpoint, its host
name is resolved once: a name that does not resolve, or a credentials
variable naming a file that is not there, fails at once as one line
instead of after every retry. tensorstore's error text (transport
failures, access denied, reads past the end of a file) is worded here as
ckpt's one line.

Nothing here touches a local file: local reads and their errors are
local.py's, containment is containment.py's.
"""
from __future__ import annotations

import math
import os
import re
import threading
import time
from typing import Any

from ..base.errors import CkptError, PathEscapeError, StorageUnavailableError, TruncatedFileError
from .nativelog import quiet_native_logs


# -- paths and URLs as kvstore specs ---------------------------------------------------

def _kvstore_spec(url: str) -> tuple[dict[str, Any], str | None]:
    """A tensorstore kvstore spec for a path or URL, and the local root if any."""
    # scheme://netloc/path by hand: urllib.parse costs every start a few ms
    scheme, sep, rest = url.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        scheme, rest = "", url
    scheme = scheme.lower()
    netloc, _, path = rest.partition("/") if scheme not in ("", "file") else ("", "", rest)
    if scheme in ("", "file"):
        root = os.path.abspath(os.path.expanduser(path if scheme == "" else "/" + path.lstrip("/")))
        return {"driver": "file", "path": root.rstrip("/") + "/"}, root
    path = path.lstrip("/")
    if path and not path.endswith("/"):
        path += "/"
    if scheme == "gs":
        return {"driver": "gcs", "bucket": netloc, "path": path}, None
    if scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": netloc, "path": path}
        # tensorstore reads credentials from the standard AWS variables and
        # files itself; the endpoint and region we pass on explicitly so that
        # S3-compatible servers (MinIO, moto) work the way the aws CLI does.
        name = "AWS_ENDPOINT_URL_S3" if os.environ.get("AWS_ENDPOINT_URL_S3") else "AWS_ENDPOINT_URL"
        endpoint = os.environ.get(name)
        if endpoint:
            # tensorstore raises a bare ValueError for anything but an http(s) URL
            # (lower case: tensorstore refuses HTTP://; and text it can pass on: no lone surrogate)
            if not re.match(r"https?://", endpoint) or endpoint.encode("utf-8", "replace").decode() != endpoint:
                raise CkptError(f"{name}={endpoint!r} is not an http:// or https:// URL", url)
            spec["endpoint"] = endpoint
        region_name = "AWS_REGION" if os.environ.get("AWS_REGION") else "AWS_DEFAULT_REGION"
        region = os.environ.get(region_name)
        if region:
            # bytes that are not UTF-8 (read as lone surrogates) tensorstore's bindings cannot take:
            # their error would name a C++ cast, not the variable
            if region.encode("utf-8", "replace").decode() != region:
                raise CkptError(f"{region_name}={region!r} is not valid text (not UTF-8)", url)
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
            # keys in the environment: skip the default chain, whose probing of
            # ~/.aws files prints error lines when they do not exist
            spec["aws_credentials"] = {"type": "environment"}
        return spec, None
    if scheme == "memory":
        return {"driver": "memory", "path": (netloc + "/" + path).strip("/") + "/"}, None
    raise _unsupported_scheme(scheme, url)


def _url_scheme(url: str) -> str:
    """The URL's scheme, lower case ("" for a plain path)."""
    scheme, sep, _ = url.partition("://")
    return scheme.lower() if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) else ""


def _unsupported_scheme(scheme: str, url: str) -> CkptError:
    if scheme in ("http", "https"):
        host, _, path = url.partition("://")[2].partition("/")
        bucket, _, key = path.partition("/")
        if host in ("storage.googleapis.com", "storage.cloud.google.com") and bucket:
            better = f"; for this bucket use gs://{bucket}/{key}"
        elif host.endswith(".s3.amazonaws.com") or re.fullmatch(r"[^.]+\.s3\.[a-z0-9-]+\.amazonaws\.com", host):
            better = f"; for this bucket use s3://{host.split('.s3.', 1)[0]}/{path}"
        else:
            better = ""
        return CkptError(
            f"{scheme}:// URLs are not supported (ckpt opens a path, file://, gs://, s3:// or memory://){better}", url,
        )
    return CkptError(f"unsupported storage URL scheme {scheme!r} (use a path, file://, gs://, s3:// or memory://)", url)


def local_path(url: str) -> str | None:
    """The absolute local path a path or file:// URL names (None for other schemes)."""
    scheme = _url_scheme(url)
    if scheme not in ("", "file"):
        return None
    return _kvstore_spec(url)[1]


def check_url(url: str) -> None:
    """Refuse a URL whose scheme no store here reads, naming the URL whole.

    For callers that cut a URL before opening it (a file's URL becomes its
    directory's): the error names what the user typed.
    """
    scheme = _url_scheme(url)
    if scheme not in ("", "file", "gs", "s3", "memory"):
        raise _unsupported_scheme(scheme, url)


# -- retries and deadlines ---------------------------------------------------------------

def _env_number(name: str, default: float, *, minimum: float, integer: bool = False) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        kind = "an integer" if integer else "a number of seconds"
        raise CkptError(f"{name} must be {kind} >= {minimum:g}, got {raw!r}")
    return value


# Seconds a remote operation may take before the run gives up on the
# endpoint, plus one second per MiB it moves (a large chunk over a slow link
# is not a dead server).
IO_TIMEOUT = _env_number("CKPT_IO_TIMEOUT", 30.0, minimum=0.001)
_SECONDS_PER_BYTE = 1.0 / 2**20
# Attempts per remote request. tensorstore's own default (32 attempts, backoff
# up to 32 s) kept an inspect of a closed port busy for 2 minutes and a
# convert from a killed server for 10; 4 attempts with 0.25-2 s between them
# (about what the AWS SDKs do) still ride out a restart or a throttled burst.
IO_RETRIES = int(_env_number("CKPT_IO_RETRIES", 4, minimum=1, integer=True))
_RETRIES = {"max_retries": IO_RETRIES, "initial_delay": "0.25s", "max_delay": "2s"}


# -- remote endpoints that stop answering ---------------------------------------

# tensorstore's words for a request that never got an answer (as opposed to an
# answer saying no: 403, 404, a precondition)
_TRANSPORT = re.compile(
    r"CURL error|retry attempts failed|Could not connect|Couldn't connect|Connection refused|Couldn't resolve|"
    r"Operation timed out|Timeout was reached|Failure when receiving|Empty reply from server|Recv failure|"
    r"Send failure|Connection reset|Server returned nothing"
)
# (when, endpoint, error) of every endpoint that stopped answering, oldest first
_FAILURES: list[tuple[float, str | None, StorageUnavailableError]] = []
_FAILURES_LOCK = threading.Lock()
# the endpoint of the last remote store opened, for errors that come from
# tensorstore calls made outside this module (array reads, OCDBT dumps)
_LAST_ENDPOINT: str | None = None
_LAST_SCHEME = ""  # "s3://" or "gs://": whose credentials an access denied is about
_LAST_REMOTE_URL = ""  # and the URL opened there (its bucket names the keys tensorstore mentions)


def raise_if_unavailable(*, endpoint: str | None = None, since: float | None = None) -> None:
    """Raise the StorageUnavailableError of an endpoint that stopped answering.

    `since` (a time.monotonic() value): the first failure recorded since then,
    however long ago (validate asks this at the end of its run). Otherwise
    fail fast: a failure of `endpoint` (any endpoint when None) within the
    last CKPT_IO_TIMEOUT seconds, so one dead server costs a run one
    deadline, not one per chunk, while a long-lived process (a notebook)
    gets to try again later.
    """
    now = time.monotonic()
    with _FAILURES_LOCK:
        for when, ep, err in _FAILURES:
            if since is not None:
                hit = when >= since
            else:
                hit = (endpoint is None or ep == endpoint) and now - when < IO_TIMEOUT
            if hit:
                raise StorageUnavailableError(err.message, err.where)


def _note_unavailable(message: str, where: str | None, endpoint: str | None) -> StorageUnavailableError:
    err = StorageUnavailableError(message, where)
    with _FAILURES_LOCK:
        _FAILURES.append((time.monotonic(), endpoint, err))
        del _FAILURES[:-64]  # bounded: only the recent ones matter
    return err


def no_answer(what: str, endpoint: str, timeout: float, where: str | None) -> StorageUnavailableError:
    """The one line for a request the endpoint did not answer within its deadline (noted, so that
    the next request to it fails fast), whoever sent it: tensorstore, or ckpt's own GCS requests."""
    return _note_unavailable(f"{what}: storage endpoint {endpoint} gave no answer within {timeout:g} s "
                             "(CKPT_IO_TIMEOUT)", where, endpoint)


def _transport_detail(text: str, endpoint: str | None) -> str:
    """A transport failure as one line naming the endpoint."""
    detail = text
    if "CURL error " in detail:
        detail = detail.split("CURL error ", 1)[1]
    detail = re.sub(r"\s*\[curl_code='?\d+'?\]", "", detail).strip()
    parts: list[str] = []
    for part in detail.split(": "):  # curl repeats its summary after the details
        if part not in parts:
            parts.append(part)
    detail = ": ".join(parts)
    m = re.search(r"All (\d+) retry attempts failed", text)
    attempts = f"; gave up after {m.group(1)} attempts (CKPT_IO_RETRIES)" if m else ""
    return f"storage endpoint {endpoint or '(unknown)'} does not answer: {detail}{attempts}"


def _endpoint_of(spec: dict[str, Any]) -> str | None:
    driver = spec.get("driver")
    if isinstance(spec.get("base"), dict):  # ocdbt over another kvstore
        return _endpoint_of(spec["base"])
    if driver == "s3":
        return spec.get("endpoint") or f"https://{spec.get('bucket')}.s3.amazonaws.com"
    if driver == "gcs":
        return os.environ.get("TENSORSTORE_GCS_HTTP_URL") or "https://storage.googleapis.com"
    return None


def _deadline(nbytes: int) -> float:
    return IO_TIMEOUT + max(0, nbytes) * _SECONDS_PER_BYTE


# -- waiting for tensorstore under the deadline ------------------------------------------

def _wait_for(future: Any, endpoint: str | None, nbytes: int, what: str, where: str) -> Any:
    """future.result(), with the deadline and the fail-fast check when the store is remote."""
    if endpoint is None:
        return future.result()
    raise_if_unavailable(endpoint=endpoint)
    timeout = _deadline(nbytes)
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        future.cancel()
        raise no_answer(what, endpoint, timeout, where) from None


def _error_for(exc: BaseException, endpoint: str | None, what: str, where: str) -> CkptError:
    """A tensorstore failure as one line: no answer from a remote endpoint, a symlink loop, or its own text."""
    text = _text(exc)
    if endpoint is not None and _TRANSPORT.search(text):
        return _note_unavailable(f"{what}: {_transport_detail(text, endpoint)}", where, endpoint)
    if "Too many levels of symbolic links" in text:
        return PathEscapeError("symlink loop (Too many levels of symbolic links)", where)
    os_error = _OS_ERROR.search(text) if endpoint is None else None
    if os_error is not None:  # permission denied, an I/O error, a full disk: the file's one line
        from .local import errno_error

        code = int(os_error.group(2))
        return errno_error(code, os.strerror(code), what, os_error.group(1))
    past_end = _past_end(text)
    if past_end is not None:  # the file that is short, named as validate names it
        message, path, size = past_end
        cause = ocdbt_truncated_cause(size) if _OCDBT_DATA_FILE.search(path) else None
        return TruncatedFileError(message, _object_url(path, where), size=size, cause=cause)
    m = _OCDBT_PAST_END.search(text)
    if m is not None:
        size = int(m.group(5))
        err = TruncatedFileError(ocdbt_truncated_message(size, int(m.group(4))), _object_url(m.group(2), where),
                                 size=size, cause=ocdbt_truncated_cause(size))
        err.ocdbt_value = (m.group(2), m.group(1))  # type: ignore[attr-defined]  # (database, key): Storage names the file
        return err
    denied = _denied(text, where) if endpoint is not None else None
    if denied is not None:
        if _credentials_hint(where):
            # no credentials at all: every request will be refused alike, so this
            # is the run's one error (validate too), not a finding per file
            return _note_unavailable(f"{what}: {denied}", where, endpoint)
        return CkptError(f"{what}: {denied}", where)
    return CkptError(f"{what}: {text}", where)


# -- before the first request to a remote endpoint ----------------------------------

# endpoint -> the problem found before its first request ("" = none)
_PREFLIGHT: dict[str, str] = {}
_PREFLIGHT_LOCK = threading.Lock()
# how long a host name lookup may take before the requests are left to find out themselves
_RESOLVE_WAIT = 5.0


def _credentials_problem(spec: dict[str, Any]) -> str | None:
    """A credentials variable naming a file that is not there (the libraries would ignore it silently)."""
    driver = spec.get("driver")
    if isinstance(spec.get("base"), dict):
        return _credentials_problem(spec["base"])
    if driver == "gcs":
        if os.environ.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):
            return None
        names = ["GOOGLE_APPLICATION_CREDENTIALS"]
    elif driver == "s3":
        if isinstance(spec.get("aws_credentials"), dict) and spec["aws_credentials"].get("type") == "environment":
            return None  # keys in the environment: no file is read
        names = ["AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE"]
    else:
        return None
    for name in names:
        path = os.environ.get(name, "")
        if not path:
            continue
        full = os.path.expanduser(path)
        if not os.path.exists(full):
            return f"{name} names {path}, which does not exist (point it at the credentials file, or unset it)"
        if os.path.isdir(full):
            return f"{name} names {path}, which is a directory, not a credentials file"
        try:
            with open(full, "rb"):
                pass
        except OSError as exc:
            return f"{name} names {path}, which cannot be read: {exc.strerror or exc}"
    return None


def _proxied(host: str) -> bool:
    """Whether requests to `host` go through an HTTP proxy (which resolves the name, not this machine)."""
    if not any(os.environ.get(v) for v in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")):
        return False
    no_proxy = (os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or "").replace(" ", "")
    for entry in filter(None, no_proxy.split(",")):
        if entry == "*" or host == entry.lstrip(".") or host.endswith("." + entry.lstrip(".")):
            return False
    return True


def _resolution_problem(endpoint: str) -> str | None:
    """Why the endpoint's host name does not resolve, or None (resolves, is an address, or is not ours to resolve).

    A name that does not resolve now will not in the next seconds either;
    tensorstore would retry it CKPT_IO_RETRIES times (seconds of backoff) for
    the same line. The lookup runs in a thread, so a resolver that does not
    answer costs at most _RESOLVE_WAIT before the requests take over.
    """
    import socket

    hostport = endpoint.partition("://")[2].split("/", 1)[0].rsplit("@", 1)[-1]
    if hostport.startswith("["):
        return None  # an IPv6 address
    host = hostport.rsplit(":", 1)[0] if hostport.count(":") == 1 else hostport
    if not host or re.fullmatch(r"[\d.]+", host) or ":" in host or _proxied(host):
        return None
    answer: list[BaseException | None] = []

    def lookup() -> None:
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            answer.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            answer.append(exc)

    worker = threading.Thread(target=lookup, name="ckpt-resolve", daemon=True)
    worker.start()
    worker.join(min(IO_TIMEOUT, _RESOLVE_WAIT))
    if not answer:
        return None  # a slow resolver: the requests themselves will find out, under their deadline
    exc = answer[0]
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve host name {host} ({exc.strerror or exc})"
    return None


def _preflight(spec: dict[str, Any], endpoint: str, url: str, what: str) -> None:
    """Checks made once per endpoint before its first request: credentials variables, then the host name."""
    quiet_native_logs()
    problem = _credentials_problem(spec)
    if problem is not None:
        raise CkptError(f"{what}: {problem}", url)
    with _PREFLIGHT_LOCK:
        known = _PREFLIGHT.get(endpoint)
    if known is None:
        known = _resolution_problem(endpoint) or ""
        with _PREFLIGHT_LOCK:
            _PREFLIGHT[endpoint] = known
    if known:
        raise _note_unavailable(f"{what}: storage endpoint {endpoint} cannot be reached: {known}; not retried", url, endpoint)


# reads in flight while a run touches an object store: each waits a round trip (10-100 ms on GCS and
# S3) on the network, not on a core, so the copy threads are not tied to the core count there
REMOTE_IN_FLIGHT = 8


def in_flight(workers: int) -> int:
    """The units a run keeps in flight: `workers` (copies sized to the cores), at least
    REMOTE_IN_FLIGHT once this process has opened an object store (a source or a destination)."""
    return max(workers, REMOTE_IN_FLIGHT) if _LAST_ENDPOINT is not None else workers


def opening(spec: dict[str, Any], url: str, what: str) -> str | None:
    """Before a kvstore is opened: the endpoint of a remote one (None for local and memory stores).

    The endpoint is remembered for the errors of tensorstore calls made
    outside this package (ts_error_text), and checked once before its first
    request (_preflight).
    """
    global _LAST_ENDPOINT, _LAST_SCHEME, _LAST_REMOTE_URL
    endpoint = _endpoint_of(spec)
    if endpoint is not None:
        _LAST_ENDPOINT = endpoint
        _LAST_SCHEME = url.partition("://")[0] + "://"
        _LAST_REMOTE_URL = url
        _preflight(spec, endpoint, url, what)
    return endpoint


# -- tensorstore's error text, as ckpt words it --------------------------------------

# what tensorstore says when a byte range of a value is past its end
# (a local file: "... not valid for value of size N"; an object store: "... and total size N")
_PAST_END = re.compile(
    r"Error reading (?:Byte range )?\[(\d+), (\d+)\) of (?:local file )?\"([^\"]+)\".*?"
    r"(?:not valid for value of size|not satisfied by response .*? and total size) (\d+)"
)
_OCDBT_DATA_FILE = re.compile(r"(?:^|/)d/[0-9a-f]{32}$")
# a value of an OCDBT database past the end of the data file it lies in: tensorstore names the
# key and the database, not the file (Storage finds the file by a walk of the database's tree)
_OCDBT_PAST_END = re.compile(
    r"Error reading \"([^\"]*)\" in OCDBT database at (?:local file )?\"([^\"]+)\".*?"
    r"Requested byte range \[(\d+), (\d+)\) is not valid for value of size (\d+)"
)
# an OS error tensorstore met on a local file: the file (the last one it names before the code) and errno
_OS_ERROR = re.compile(r"\"([^\"]+)\"[^\"]*\[os_error_code='?(\d+)'?\]")
_DENIED = re.compile(r"\b(PERMISSION_DENIED|UNAUTHENTICATED)\b")
_HTTP_CODE = re.compile(r"\[http_response_code='?(\d+)'?\]")
_TRAILERS = re.compile(r"\s*\[[A-Za-z0-9_.-]+='[^']*'\]")
# what a kvstore says of a value's size when a byte range misses it: the file and memory drivers
# ("value of size N"), a range past the end ("... and total size N"), S3's refusal of a range that
# starts past the end (ActualObjectSize), a server answering such a range anyway (Content-Range)
_SIZE_IN_ERROR = re.compile(
    r"(?:value of size |and total size |<ActualObjectSize>|Content-Range header received: \"bytes \d+-\d+/)(\d+)"
)


def ocdbt_truncated_cause(size: int) -> str:
    """What is wrong with a truncated OCDBT data file, the same words for every value past its end."""
    return f"OCDBT data file has {size:,} bytes, fewer than the values the database places in it need"


def ocdbt_truncated_message(size: int, needed: int) -> str:
    """A truncated OCDBT data file, in the words `ckpt validate` uses (lost-process-data)."""
    return f"OCDBT data file has {size} bytes but the database needs {needed}"


def _past_end(text: str) -> tuple[str, str, int] | None:
    """(message, file, its size) for a read past the end of a stored file, else None."""
    m = _PAST_END.search(text)
    if m is None:
        return None
    end, path, size = int(m.group(2)), m.group(3), int(m.group(4))
    if _OCDBT_DATA_FILE.search(path):
        return ocdbt_truncated_message(size, end), path, size
    return f"truncated: needed bytes [{m.group(1)}, {end}) but it has {size} bytes", path, size


def _object_url(path: str, where: str) -> str:
    """A file tensorstore names (a local path, or a key in the bucket of `where`) as ckpt names files."""
    scheme, sep, rest = where.partition("://")
    if os.path.isabs(path) or not sep or scheme == "file":
        return path
    return f"{scheme}://{rest.split('/', 1)[0]}/{path}"


def _credentials_hint(where: str) -> str:
    """What to do about an access denied by a remote store, when no credentials were configured."""
    env = os.environ
    if where.startswith("s3://"):
        configured = (
            (env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY")) or env.get("AWS_PROFILE")
            or env.get("AWS_WEB_IDENTITY_TOKEN_FILE") or env.get("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
            or env.get("AWS_CONTAINER_CREDENTIALS_FULL_URI")
            or os.path.exists(os.path.expanduser(env.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"))
        )
        return "" if configured else (
            "; no AWS credentials in the environment or ~/.aws (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "or AWS_PROFILE, or write ~/.aws/credentials)"
        )
    if where.startswith("gs://"):
        gcloud = os.path.join(env.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud"),
                              "application_default_credentials.json")
        configured = env.get("GOOGLE_APPLICATION_CREDENTIALS") or env.get("GOOGLE_AUTH_TOKEN_FOR_TESTING") or os.path.exists(gcloud)
        return "" if configured else (
            "; no Google credentials file (set GOOGLE_APPLICATION_CREDENTIALS, "
            "or run `gcloud auth application-default login`)"
        )
    return ""


def _denied(text: str, where: str) -> str | None:
    """An access refused by a remote store, as one line (HTTP code, what to do), else None."""
    m = _DENIED.search(text)
    code = _HTTP_CODE.search(text)
    if m is None and not (code and code.group(1) in ("401", "403")):
        return None
    status = f"HTTP {code.group(1)}" if code else (m.group(1) if m else "")
    # the store's own reason, when it gave one (GCS: "... does not have storage.objects.get access")
    detail = _TRAILERS.sub("", text[m.end():] if m else "").lstrip(": ").strip()
    detail = "" if detail.lower() in ("", "unknown") else f": {detail[:200]}"
    return f"access denied ({status}){detail}{_credentials_hint(where)}"


def _text(exc: BaseException) -> str:
    text = str(exc).split(" [source locations=", 1)[0].split(" [tensorstore_spec=", 1)[0]
    return text.splitlines()[0] if text else type(exc).__name__


def ts_error_text(exc: BaseException) -> str:
    """tensorstore error text without its source-location trailer.

    A remote request that got no answer is worded as such, naming the
    endpoint, and remembered: the rest of the run fails fast (see
    raise_if_unavailable).
    """
    text = _text(exc)
    if _LAST_ENDPOINT is not None and _TRANSPORT.search(text):
        text = _transport_detail(text, _LAST_ENDPOINT)
        _note_unavailable(text, None, _LAST_ENDPOINT)
        return text
    past_end = _past_end(text)
    if past_end is not None:
        message, path, _ = past_end
        return f"{_object_url(path, _LAST_REMOTE_URL) if _LAST_ENDPOINT else path}: {message}"
    denied = _denied(text, _LAST_SCHEME) if _LAST_ENDPOINT is not None else None
    if denied is not None and _credentials_hint(_LAST_SCHEME):
        _note_unavailable(denied, None, _LAST_ENDPOINT)  # no credentials: the run's one error
    return denied or text
