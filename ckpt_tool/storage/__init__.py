"""One storage layer over tensorstore's kvstore drivers.

A Storage is a checkpoint root (a local directory, file://, gs://, s3:// or
memory://) seen as a flat key space: list keys, read a value or a byte range,
ask a value's size. Every reader goes through it, so the rule that no key
may leave the root (`..`, absolute keys, symlinks pointing out, FIFOs and
other non-files) is enforced here, once.

`Storage.ocdbt()` gives the same interface over an OCDBT database (Orbax's
key space inside `manifest.ocdbt` + data files), so readers handle OCDBT and
plain directories alike.

Remote stores (s3://, gs://) never hang: tensorstore retries a failed request
at most CKPT_IO_RETRIES times with a short backoff, and every operation this
module waits for has a deadline (CKPT_IO_TIMEOUT seconds, plus a second per
MiB moved). The first endpoint that stops answering is remembered; every
later remote operation fails at once with the same one line
(StorageUnavailableError), so a run ends within the deadline instead of
retrying each chunk. Before the first request to an endpoint, its host
name is resolved once: a name that does not resolve, or a credentials
variable naming a file that is not there, fails at once as one line
instead of after every retry. The C++ libraries under tensorstore (abseil,
the AWS C SDK) log to file descriptor 2 (credential probing, IMDS lookups);
once a remote store is opened those lines are dropped (see
quiet_native_logs), so a failure is ckpt's one line, unless CKPT_DEBUG=1.

Local roots are contained: every key read is checked (no `..`, no symlink
out of the root, regular files only, opened non-blocking so a FIFO swapped
in never blocks), and before tensorstore opens a directory itself (an OCDBT
database, a plain zarr array) the directory is scanned once per run for
links out, symlink loops and FIFOs, devices or sockets (`guard`).
"""
from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import re
import stat
import sys
import threading
import time
from collections import Counter
from typing import Any, Iterable, Iterator

import tensorstore as ts

from .. import directio
from ..errors import CkptError, NotFoundError, PathEscapeError, StorageUnavailableError
from ..pagecache import DirectoryDropper, WriteBehind



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

# One context for every open: memory:// stores are shared within a process
# and tensorstore's cache pools and thread pools are reused. Writers derive
# theirs from it, so the retry bounds apply to every request ckpt makes.
_CONTEXT = ts.Context(
    {"s3_request_retries": _RETRIES, "gcs_request_retries": _RETRIES, "http_request_retries": _RETRIES}
)
# Array reads get their own context with a small decoded-chunk cache: a
# reshard cuts several output chunks from one source chunk, and without a
# cache each of them decodes that chunk again. Writers keep _CONTEXT, so
# nothing they write is cached. Local files are read with pread, not through
# memory maps: a mapped source file that shrinks while it is read (another
# process rewriting the checkpoint) kills the process with SIGBUS, where a
# read just comes back short and fails as one line. (Mapping saved ~0.4 s of
# a 2 GiB reshard; CKPT_MMAP_READS=1 brings it back for sources known not to
# change.)
_READ_CONTEXT = ts.Context(
    {"cache_pool": {"total_bytes_limit": 64 * 2**20}}
    | ({"file_io_mode": {"mode": "memmap"}} if os.environ.get("CKPT_MMAP_READS", "") not in ("", "0") else {}),
    parent=_CONTEXT,
)

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


def _debug() -> bool:
    return os.environ.get("CKPT_DEBUG", "") not in ("", "0")


# -- the C++ libraries' own logging ------------------------------------------------
#
# tensorstore's dependencies log to file descriptor 2 themselves: the AWS C
# SDK when its default credentials chain finds no ~/.aws files or no IMDS,
# tensorstore when no gcloud credentials file exists (an anonymous read of a
# public bucket prints it too). None of it can be turned off from Python:
# abseil's thresholds are not exposed by the tensorstore module, and neither
# TENSORSTORE_VERBOSE_LOGGING nor GRPC_VERBOSITY touches these lines. So once
# a remote store is opened, fd 2 becomes a pipe whose reader drops abseil's
# lines and passes everything else on, and Python's sys.stderr writes to the
# original stream directly (ordering and terminal detection unchanged).

# abseil's prefix: severity, MMDD, time, thread id, file:line]
_NATIVE_LOG_LINE = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\n]*\] ")
_NATIVE_PREAMBLE = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_NATIVE_LOG_START = re.compile(rb"^(?:[IWEF](?:\d{0,4}(?: [\d:.]*(?: +\d*(?: [^\]\n]*)?)?)?)?)$")
_native_quiet = False
_native_quiet_lock = threading.Lock()


def _is_native_log(line: bytes) -> bool:
    return bool(_NATIVE_LOG_LINE.match(line)) or line.startswith(_NATIVE_PREAMBLE)


def _forward_stderr(read_fd: int, write_fd: int) -> None:
    """Copy the pipe behind fd 2 to the real stderr, without the C++ libraries' log lines."""
    pending = b""
    while True:
        try:
            chunk = os.read(read_fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        out = [line + b"\n" for line in lines if not _is_native_log(line)]
        # a partial line (a progress bar's \r update) goes on at once unless it may be a log line's start
        if pending and not (_NATIVE_LOG_START.match(pending) or _NATIVE_PREAMBLE.startswith(pending)):
            out.append(pending)
            pending = b""
        _write_all(write_fd, b"".join(out))
    if pending and not _is_native_log(pending):
        _write_all(write_fd, pending)
    os.close(read_fd)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:
            return  # the reader of stderr went away: nothing more to show


def quiet_native_logs() -> None:
    """Drop the C++ libraries' log lines from file descriptor 2 for the rest of the process.

    Called when the first remote store is opened (local runs never pay for
    it); a no-op with CKPT_DEBUG=1, which keeps every line, or where fd 2
    cannot be redirected. Everything that is not an abseil-formatted line
    still reaches stderr.
    """
    global _native_quiet
    if _native_quiet or _debug():
        return
    with _native_quiet_lock:
        if _native_quiet:
            return
        _native_quiet = True
        stream = sys.stderr
        try:
            rebind = stream is not None and stream.fileno() == 2
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            rebind = False  # a notebook's or a test runner's stream: not fd 2, leave it
        try:
            if stream is not None:
                stream.flush()
            real = os.dup(2)
            read_fd, write_fd = os.pipe()
        except (OSError, ValueError):
            return
        if rebind:
            # Python's own stderr writes bypass the pipe: same order, same terminal
            sys.stderr = io.TextIOWrapper(
                io.FileIO(real, "w", closefd=False), encoding=stream.encoding, errors=stream.errors,
                line_buffering=True, write_through=True,
            )
            import faulthandler

            if faulthandler.is_enabled():  # a crash report must not depend on the reader thread
                faulthandler.enable(file=sys.stderr)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        threading.Thread(target=_forward_stderr, args=(read_fd, real), name="ckpt-stderr", daemon=True).start()


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


# -- tensorstore's error text, as ckpt words it --------------------------------------

# what tensorstore says when a byte range of a value is past its end
# (a local file: "... not valid for value of size N"; an object store: "... and total size N")
_PAST_END = re.compile(
    r"Error reading (?:Byte range )?\[(\d+), (\d+)\) of (?:local file )?\"([^\"]+)\".*?"
    r"(?:not valid for value of size|not satisfied by response .*? and total size) (\d+)"
)
_OCDBT_DATA_FILE = re.compile(r"(?:^|/)d/[0-9a-f]{32}$")
_DENIED = re.compile(r"\b(PERMISSION_DENIED|UNAUTHENTICATED)\b")
_HTTP_CODE = re.compile(r"\[http_response_code='?(\d+)'?\]")
_TRAILERS = re.compile(r"\s*\[[A-Za-z0-9_.-]+='[^']*'\]")


def ocdbt_truncated_message(size: int, needed: int) -> str:
    """A truncated OCDBT data file, in the words `ckpt validate` uses (lost-process-data)."""
    return f"OCDBT data file has {size} bytes but the database needs {needed}"


def _past_end(text: str) -> tuple[str, str] | None:
    """(message, file) for a read past the end of a stored file, else None."""
    m = _PAST_END.search(text)
    if m is None:
        return None
    end, path, size = int(m.group(2)), m.group(3), int(m.group(4))
    if _OCDBT_DATA_FILE.search(path):
        return ocdbt_truncated_message(size, end), path
    return f"truncated: needed bytes [{m.group(1)}, {end}) but it has {size} bytes", path


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


# -- containment of local directories that tensorstore opens itself -----------------


class _Containment:
    """What one scan of a local checkpoint found: links out, loops, non-regular files.

    Built per opened root and shared by its children; each sub-directory is
    scanned once, when tensorstore is first about to open something under it.
    A symlink is followed only to resolve it, never walked: a link to a
    directory inside the root is checked through the target's own scan.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self._lock = threading.Lock()
        self._scanned: set[str] = set()  # sub-directories (relative, "" = root) already walked
        self.problems: dict[str, tuple[str, bool]] = {}  # rel -> (message, is a loop)
        self._linked_dirs: dict[str, str] = {}  # rel of a link to a directory inside -> rel of its target

    def _inside(self, real: str) -> bool:
        return real == self.real_root or real.startswith(self.real_root.rstrip(os.sep) + os.sep)

    def _covered(self, rel: str) -> bool:
        return any(s == "" or rel == s or rel.startswith(s + "/") for s in self._scanned)

    def _scan(self, rel: str) -> None:
        stack = [rel]
        while stack:
            d = stack.pop()
            path = os.path.join(self.root, d) if d else self.root
            try:
                entries = list(os.scandir(path))
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    self.problems[d] = ("symlink loop (Too many levels of symbolic links)", True)
                elif exc.errno != errno.ENOTDIR:
                    self.problems[d] = (f"cannot list: {exc.strerror or exc}", False)
                continue
            for entry in entries:
                sub = f"{d}/{entry.name}" if d else entry.name
                try:
                    if entry.is_symlink():
                        self._check_link(sub, entry.path)
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append(sub)
                    elif not entry.is_file(follow_symlinks=False):
                        self.problems[sub] = ("not a regular file (refusing to open a FIFO, device or socket)", False)
                except OSError as exc:
                    self.problems[sub] = (f"cannot stat: {exc.strerror or exc}", False)
        self._scanned.add(rel)

    def _check_link(self, rel: str, path: str) -> None:
        real = os.path.realpath(path)
        if not self._inside(real):
            self.problems[rel] = (f"symlink to {real}, outside the checkpoint", False)
            return
        try:
            st = os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                self.problems[rel] = ("symlink loop (Too many levels of symbolic links)", True)
            # a dangling link inside the root: the read reports it missing
            return
        if stat.S_ISDIR(st.st_mode):
            target = os.path.relpath(real, self.real_root).replace(os.sep, "/")
            self._linked_dirs[rel] = "" if target == "." else target
        elif not stat.S_ISREG(st.st_mode):
            self.problems[rel] = ("symlink to a FIFO, device or socket (refusing to open it)", False)

    def check(self, rel: str) -> list[tuple[str, str, bool]]:
        """Every problem at, under or above `rel` (relative to the root; "" = all): (path, message, loop)."""
        with self._lock:
            found: list[tuple[str, str, bool]] = []
            todo, seen = [rel], set()
            while todo:
                r = todo.pop()
                if r in seen:
                    continue
                seen.add(r)
                if not self._covered(r):
                    self._scan(r)
                for p, (msg, loop) in self.problems.items():
                    if not r or p == r or p.startswith(r + "/") or r.startswith(p + "/"):
                        found.append((p, msg, loop))
                # links to directories inside the root: their targets are read too
                for p, t in self._linked_dirs.items():
                    if not r or p == r or p.startswith(r + "/"):
                        todo.append(t)
                    elif r.startswith(p + "/"):  # `rel` is reached through the link
                        todo.append((t + "/" if t else "") + r[len(p) + 1 :])
            return sorted(set(found))

_SIZE_IN_ERROR = re.compile(r"value of size (\d+)")


class ReadLog:
    """Counts reads per key, so tests can prove which values were touched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reads: Counter[str] = Counter()

    def record(self, key: str) -> None:
        with self._lock:
            self.reads[key] += 1


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
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
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


class LocalFileWriter:
    """A new local file that several threads fill at offsets they reserved.

    `close()` fsyncs it, as tensorstore's file kvstore does for every value
    it writes; `discard()` just closes it (the output is being thrown away).
    Large ranges go to the disk with O_DIRECT where the file system suits it
    (see directio.py); `place()` then aligns them, so callers reserve their
    offsets through it. What is written buffered goes to disk behind the
    writer and leaves the page cache (see pagecache.py).
    """

    def __init__(self, path: str, where: str, *, direct: bool = False) -> None:
        self.where = where
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise CkptError(f"cannot create: {exc.strerror or exc}", where) from exc
        self._behind = WriteBehind(self._fd)
        self._direct_fd = -1
        if direct:
            try:  # a second descriptor, so small writes stay buffered
                self._direct_fd = os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))  # type: ignore[attr-defined]
            except OSError:
                pass  # the file system refuses O_DIRECT after all: all buffered
        self._direct = self._direct_fd >= 0  # cleared if the device refuses our alignment
        self._lock = threading.Lock()
        self._end = 0  # the end of the data written so far (direct writes' padding excluded)

    def place(self, cursor: int, length: int) -> tuple[int, int]:
        """Where a range of `length` bytes reserved at `cursor` starts, and the next free cursor."""
        if self._direct and length >= directio.MIN_DIRECT_BYTES:
            start = directio.align_up(cursor)
            return start, start + directio.align_up(length)
        return cursor, cursor + length

    def write_at(self, offset: int, parts: Iterable[Any], *, padded: bool = True) -> None:
        """Write the buffers back to back from `offset` (reserved through `place`).

        padded=False: the range was not reserved through `place` as one piece
        (several small ranges written as one), so it must not be written
        direct, whose zeros up to the next 4 KiB would cover its neighbour.
        """
        views = [memoryview(p).cast("B") for p in parts]
        length = sum(v.nbytes for v in views)
        with self._lock:
            self._end = max(self._end, offset + length)
        if padded and self._direct and length >= directio.MIN_DIRECT_BYTES and not offset % directio.ALIGNMENT:
            try:
                directio.write_direct(self._direct_fd, offset, views)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise CkptError(f"cannot write: {exc.strerror or exc}", self.where) from exc
                # the device wants a coarser alignment than ALIGNMENT: write
                # this range buffered, and place the next ones unaligned (the
                # descriptor stays open until close: another thread may be using it)
                self._direct = False
        self._write_buffered(offset, views)

    def _write_buffered(self, offset: int, views: list[memoryview]) -> None:
        start = offset
        try:
            while views:
                written = os.pwritev(self._fd, views, offset)
                if written == 0 and any(v.nbytes for v in views):
                    raise CkptError("cannot write: the file system took no bytes", self.where)
                offset += written
                # a short write (a signal, a full disk on the next call): go on from there
                while views and written >= views[0].nbytes:
                    written -= views[0].nbytes
                    views.pop(0)
                if views and written:
                    views[0] = views[0][written:]
        except OSError as exc:
            raise CkptError(f"cannot write: {exc.strerror or exc}", self.where) from exc
        self._behind.written(start, offset - start)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if os.fstat(fd).st_size > self._end:
                os.ftruncate(fd, self._end)  # the zeros padding the last direct write
            os.fsync(fd)
            self._behind.finish()
        except OSError as exc:
            raise CkptError(f"cannot write: {exc.strerror or exc}", self.where) from exc
        finally:
            self._behind.close()  # after a failed fsync too: no background work may outlive the descriptor
            self._close_direct()
            os.close(fd)

    def discard(self) -> None:
        """Close without syncing (the output is being thrown away); a no-op once closed."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            self._behind.close()  # no background work may outlive the descriptor
            self._close_direct()
            try:
                os.close(fd)
            except OSError:
                pass

    def _close_direct(self) -> None:
        fd, self._direct_fd = self._direct_fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


class PendingReads:
    """Reads started by `Storage.start_reads`; `result()` waits for them all."""

    def __init__(self, storage: Storage, futures: dict[str, Any]) -> None:
        self._storage = storage
        self._futures = futures

    def result(self) -> dict[str, bytes | None]:
        """Each key's bytes, or None where the key is missing."""
        out: dict[str, bytes | None] = {}
        for key, fut in self._futures.items():
            res = self._storage.wait(fut, "cannot read", self._storage._where(key))
            out[key] = bytes(res.value) if res.state == "value" else None
        return out


def _check_relative(key: str, where: str) -> str:
    """Refuse keys that are absolute or climb out of the root."""
    if "\x00" in key:
        raise PathEscapeError(f"path {key!r} contains a NUL byte", where)
    if ".." not in key and "\\" not in key and "//" not in key and not key.startswith(("/", "./")) and ":" not in key[:3] and "/./" not in key:
        return key.rstrip("/") if key.endswith("/") else key  # the common, clean case, checked cheaply
    if key.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:[\\/]", key):
        raise PathEscapeError(f"absolute path {key!r} escapes the checkpoint", where)
    parts = re.split(r"[\\/]", key)
    if any(p == ".." for p in parts):
        raise PathEscapeError(f"path {key!r} escapes the checkpoint", where)
    return "/".join(p for p in parts if p not in ("", "."))


class Storage:
    """A checkpoint root on any tensorstore kvstore."""

    def __init__(
        self,
        kvstore: ts.KvStore,
        url: str,
        *,
        spec: dict[str, Any],
        local_root: str | None = None,
        log: ReadLog | None = None,
        check_local: bool = True,
        containment: _Containment | None = None,
        contain_base: str = "",
    ) -> None:
        self._kv = kvstore
        # the JSON spec we opened with: KvStore.spec() drops context resources
        # such as aws_credentials, so derived stores are built from this one
        self._spec = spec
        self.url = url.rstrip("/") if url not in ("/",) else url
        self.local_root = local_root
        self.log = log or ReadLog()
        # OCDBT views resolve keys inside the database, not on the filesystem
        self._check_local = check_local and local_root is not None
        # every key under the root, once listed (see list())
        self._listing: list[str] | None = None
        # when this store was opened (time.monotonic()): failures since then belong to this run
        self.opened_at = time.monotonic()
        # remote stores: the endpoint named when it stops answering, and deadlines apply
        self._endpoint = _endpoint_of(spec)
        # local roots opened for reading: the scan behind guard(), and where this root sits in it
        self._containment = containment
        self._contain_base = contain_base

    # -- opening ---------------------------------------------------------
    @classmethod
    def open(cls, url: str, log: ReadLog | None = None) -> "Storage":
        spec, local_root = _kvstore_spec(url)
        if local_root is not None:
            try:
                st = os.stat(local_root)
            except FileNotFoundError:
                raise NotFoundError("no such directory", url) from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PathEscapeError("symlink loop (Too many levels of symbolic links)", url) from None
                raise CkptError(f"cannot open: {exc.strerror or exc}", url) from None
            if not stat.S_ISDIR(st.st_mode):
                raise NotFoundError("is a file, not a checkpoint directory", url)
        kv = cls._open_kvstore(spec, url)
        return cls(kv, url, spec=spec, local_root=local_root, log=log,
                   containment=_Containment(local_root) if local_root is not None else None)

    @staticmethod
    def _open_kvstore(spec: dict[str, Any], url: str, what: str = "cannot open storage") -> ts.KvStore:
        global _LAST_ENDPOINT, _LAST_SCHEME, _LAST_REMOTE_URL
        endpoint = _endpoint_of(spec)
        if endpoint is not None:
            _LAST_ENDPOINT = endpoint
            _LAST_SCHEME = url.partition("://")[0] + "://"
            _LAST_REMOTE_URL = url
            _preflight(spec, endpoint, url, what)
        try:
            fut = ts.KvStore.open(spec, context=_CONTEXT)
        except Exception as exc:  # tensorstore raises ValueError for bad specs
            raise _error_for(exc, endpoint, what, url) from exc
        return _wait_for(fut, endpoint, 0, what, url)

    def child(self, relpath: str) -> "Storage":
        """The storage rooted at a sub-directory (containment checked)."""
        rel = _check_relative(relpath, self.url)
        if not rel:
            return self
        if self._check_local:
            self._check_local_path(rel, want_dir=True)
        kv = self._kv / (rel + "/")
        local = os.path.join(self.local_root, rel) if self.local_root else None
        child = Storage(
            kv, f"{self.url}/{rel}", spec=self._spec_for(rel + "/"),
            local_root=local, log=self.log, check_local=self._check_local,
            containment=self._containment, contain_base=self._contained(rel),
        )
        if self._listing is not None:
            # the sub-directory's part of the listing: no new LIST
            cut = len(rel) + 1
            child._listing = [k[cut:] for k in self._listing if k.startswith(rel + "/")]
        return child

    def ocdbt(self, subdir: str = "") -> "Storage":
        """A view of the OCDBT database whose manifest lives at `subdir`."""
        base = self.child(subdir) if subdir else self
        base.guard()  # the manifest, the data files and (at the root) every process's database
        spec = {"driver": "ocdbt", "base": base._spec}
        kv = self._open_kvstore(spec, base.url, "cannot open OCDBT database")
        return Storage(kv, base.url + " (ocdbt)", spec=spec, local_root=None, log=self.log, check_local=False)

    def kvstore_spec(self, subpath: str = "") -> dict[str, Any]:
        """The kvstore spec (JSON) for `subpath`, for opening arrays with tensorstore.

        tensorstore then opens files under `subpath` without asking this
        layer, so the directory is checked first (see guard).
        """
        self.guard(subpath)
        return self._spec_for(subpath)

    def _spec_for(self, subpath: str) -> dict[str, Any]:
        rel = _check_relative(subpath, self.url) if subpath else ""
        if subpath.endswith("/") and rel:
            rel += "/"
        spec = dict(self._spec)
        spec["path"] = spec.get("path", "") + rel
        return spec

    def guard(self, subpath: str = "") -> None:
        """Refuse to let tensorstore open anything under `subpath` (local roots opened for reading)
        when it holds a symlink out of the checkpoint, a symlink loop, or a FIFO, device or socket.

        The directory is scanned once per run; later calls cost a lookup.
        """
        if self._containment is None or not self._check_local:
            return
        rel = _check_relative(subpath, self.url) if subpath else ""
        problems = self._containment.check(self._contained(rel))
        if problems:
            path, message, _loop = problems[0]
            raise PathEscapeError(message, self._root_where(path))

    def containment_problems(self) -> list[tuple[str, str]]:
        """Every symlink out, symlink loop and non-regular file under this local root: (path, message).

        Paths are relative to this root; validate reports each as `path-escape`.
        """
        if self._containment is None or not self._check_local:
            return []
        base = self._contain_base
        out = []
        for path, message, _loop in self._containment.check(base):
            if base and path.startswith(base + "/"):
                path = path[len(base) + 1 :]
            elif base and path != base:
                continue  # above this root (a link it is reached through): reported by its own path
            out.append((path, message))
        return out

    def _contained(self, rel: str) -> str:
        """`rel` (relative to this root) as a path relative to the scanned root."""
        if not self._contain_base:
            return rel
        return f"{self._contain_base}/{rel}" if rel else self._contain_base

    def _root_where(self, contained: str) -> str:
        """A path of the scan, as a one-line error names it."""
        assert self._containment is not None
        root = self._containment.root
        return os.path.join(root, contained) if contained else root

    @property
    def context(self) -> ts.Context:
        return _CONTEXT

    @property
    def read_context(self) -> ts.Context:
        """For opening arrays to read: shares _CONTEXT's resources plus a chunk cache."""
        return _READ_CONTEXT

    # -- reading ---------------------------------------------------------
    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (recursive), relative to the root, sorted.

        The whole root is listed once per Storage and remembered: a reader
        asks for it several times (format detection, then the reader itself,
        sub-directories of a CheckpointManager root), and on S3 or GCS each
        would be another round of LIST requests. It is a snapshot; writing
        through this Storage forgets it.
        """
        rel = _check_relative(prefix, self.url) if prefix else ""
        if rel and not rel.endswith("/"):
            rel += "/"
        if self._listing is not None:
            return [k for k in self._listing if k.startswith(rel)] if rel else list(self._listing)
        keys = self._list_uncached(rel)
        if not rel:
            self._listing = keys
            return list(keys)
        return keys

    def _list_uncached(self, rel: str) -> list[str]:
        try:
            if rel:
                rng = ts.KvStore.KeyRange(inclusive_min=rel, exclusive_max=rel[:-1] + chr(ord("/") + 1))
                fut = self._kv.list(rng)
            else:
                fut = self._kv.list()
        except Exception as exc:
            raise self._error(exc, "cannot list keys", self.url) from exc
        keys = self.wait(fut, "cannot list keys", self.url)
        return sorted(k.decode("utf-8", "surrogateescape") for k in keys)

    def listdir(self, prefix: str = "") -> tuple[list[str], list[str]]:
        """Immediate sub-directories and files under `prefix`."""
        rel = _check_relative(prefix, self.url) if prefix else ""
        start = len(rel) + 1 if rel else 0
        dirs: set[str] = set()
        files: list[str] = []
        for key in self.list(rel):
            rest = key[start:]
            if "/" in rest:
                dirs.add(rest.split("/", 1)[0])
            else:
                files.append(rest)
        return sorted(dirs), files

    def exists(self, key: str) -> bool:
        rel = _check_relative(key, self.url)
        if self._check_local:
            path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
            return os.path.lexists(path)
        try:
            res = self._wait(self._kv.read(rel, byte_range=slice(0, 0)), 0, "cannot read", self._where(rel))
        except StorageUnavailableError:
            raise
        except Exception as exc:
            if isinstance(exc, CkptError) or not _TRANSPORT.search(_text(exc)):
                return True  # it exists but is shorter than the probe: still exists
            raise self._error(exc, "cannot read", self._where(rel)) from exc
        return res.state == "value"

    def read(self, key: str) -> bytes:
        """The whole value at `key`; NotFoundError when missing."""
        return self._read(key, None)

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the value at `key`; an error if it is shorter."""
        if start < 0 or end < start:
            raise CkptError(f"invalid byte range [{start}, {end})", self._where(key))
        if end == start:
            return b""
        return self._read(key, slice(start, end))

    def read_range_into(self, key: str, start: int, buffer: Any) -> None:
        """Fill the writable `buffer` with the bytes of `key` from `start`; an error if it is shorter.

        The bulk path for tensor data: a local file is read straight into the
        caller's buffer with preadv (one copy, by the kernel). Through the
        file kvstore the same 2 GiB of DCP chunks took 3.3 s instead of 0.3 s
        here: tensorstore reads into fresh buffers of its own and hands them
        over as bytes, a copy or two more per chunk.
        """
        view = memoryview(buffer).cast("B")
        size = view.nbytes
        if start < 0:
            raise CkptError(f"invalid byte range [{start}, {start + size})", self._where(key))
        if size == 0:
            return
        if not self._check_local:
            view[:] = self.read_range(key, start, start + size)
            return
        with self._local_read(key) as (rel, fd):
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], start + got)
                if n == 0:  # a regular file reads short only at its end
                    raise self._truncated(rel, fd, start, start + size)
                got += n

    def _pread_local(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a local file by pread (see read_range_into for why)."""
        with self._local_read(key) as (rel, fd):
            data = os.pread(fd, end - start, start)
            if len(data) < end - start:  # a regular file reads short only at its end
                raise self._truncated(rel, fd, start, end)
            return data

    @contextlib.contextmanager
    def _local_read(self, key: str) -> Iterator[tuple[str, int]]:
        """The checked key and a descriptor of its local file, logged as read; OS errors become one line."""
        rel = self._checked(key)
        self.log.record(rel)
        try:
            # non-blocking: a FIFO put in place after the check must not block the open
            fd = os.open(
                os.path.join(self.local_root, rel),  # type: ignore[arg-type]
                os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
            )
        except FileNotFoundError:
            raise NotFoundError("missing", self._where(rel)) from None
        except OSError as exc:
            raise _os_error(exc, "cannot read", self._where(rel)) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped in after the check
                raise PathEscapeError("not a regular file (refusing to read a FIFO, device or socket)", self._where(rel))
            yield rel, fd
        except OSError as exc:
            raise CkptError(f"cannot read: {exc.strerror or exc}", self._where(rel)) from exc
        finally:
            os.close(fd)

    def _read_whole_local(self, key: str) -> bytes:
        """A whole local file, through the same checked, non-blocking open as byte ranges."""
        with self._local_read(key) as (_rel, fd):
            parts = []
            want = max(os.fstat(fd).st_size, 1 << 16)
            while True:
                part = os.read(fd, want)
                if not part:
                    return b"".join(parts)
                parts.append(part)

    def _truncated(self, rel: str, fd: int, start: int, end: int) -> CkptError:
        return CkptError(
            f"truncated: needed bytes [{start}, {end}) but it has {os.fstat(fd).st_size} bytes", self._where(rel)
        )

    def read_many(self, keys: Iterable[str]) -> dict[str, bytes | None]:
        """Read several keys concurrently (None for a missing key)."""
        return self.start_reads(keys).result()

    def start_reads(self, keys: Iterable[str]) -> "PendingReads":
        """Start reading several keys; the caller may do other work before `.result()`."""
        futures = {}
        for key in keys:
            rel = self._checked(key)
            self.log.record(rel)
            futures[key] = self._kv.read(rel)
        return PendingReads(self, futures)

    def size(self, key: str) -> int:
        """The size in bytes of the value at `key`, without reading it where possible."""
        rel = self._checked(key)
        if self._check_local:
            try:
                return os.stat(os.path.join(self.local_root, rel)).st_size  # type: ignore[arg-type]
            except FileNotFoundError:
                raise
            except OSError as exc:
                raise _os_error(exc, "cannot stat", self._where(rel)) from None
        # kvstores have no stat: an out-of-range probe makes the driver state
        # the size; drivers that do not say so fall back to a full read.
        try:
            res = self._wait(self._kv.read(rel, byte_range=slice(1 << 62, (1 << 62) + 1)), 0, "cannot read", self._where(rel))
        except ValueError as exc:
            m = _SIZE_IN_ERROR.search(str(exc))
            if m:
                return int(m.group(1))
            if _TRANSPORT.search(_text(exc)):
                raise self._error(exc, "cannot read", self._where(rel)) from exc
            return len(self.read(key))
        if res.state != "value":
            raise NotFoundError("missing", self._where(key))
        return len(self.read(key))

    # -- writing ---------------------------------------------------------
    @classmethod
    def create(cls, url: str, log: ReadLog | None = None) -> "Storage":
        """Open a destination, creating a local directory if needed."""
        spec, local_root = _kvstore_spec(url)
        if local_root is not None:
            try:
                os.makedirs(local_root, exist_ok=True)
            except OSError as exc:
                raise _os_error(exc, "cannot create", url) from None
        kv = cls._open_kvstore(spec, url)
        return cls(kv, url, spec=spec, local_root=local_root, log=log)

    def delete(self, key: str) -> None:
        """Remove one value (missing is fine)."""
        rel = _check_relative(key, self.url)
        self._listing = None
        self.wait(self._kv.write(rel, None), "cannot delete", self._where(rel))  # tensorstore deletes on None

    def write(self, key: str, data: bytes | bytearray) -> None:
        """Write a whole value (the file driver fsyncs it before returning)."""
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        self._listing = None
        fut = self._kv.write(rel, data)
        # tensorstore reads `data` in place until the write is over, which on a
        # deadline may be after we return: the callback holds it until then
        fut.add_done_callback(lambda _f, _keep=data: None)
        self.wait(fut, "cannot write", self._where(rel), nbytes=len(data))

    def create_local_file(self, key: str) -> "LocalFileWriter | None":
        """A new file at `key` for writing at known offsets, on local roots only (else None).

        The bulk path for DCP data files: archives go from the caller's arrays
        to the file with pwritev, where a kvstore write first copies the whole
        file into a buffer of its own.
        """
        if not self._check_local:
            return None
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        self._listing = None
        path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._check_local_path(rel, want_dir=False)
        return LocalFileWriter(path, self._where(rel), direct=directio.supported(os.path.dirname(path)))

    def page_cache_dropper(self, subdir: str) -> "DirectoryDropper | None":
        """Drops from the page cache what another library writes under `subdir`
        (tensorstore's OCDBT data files), on local roots only (else None)."""
        if self.local_root is None:
            return None
        rel = _check_relative(subdir, self.url)
        return DirectoryDropper(os.path.join(self.local_root, rel))

    def fsync_tree(self, subdir: str) -> None:
        """fsync every file and directory under `subdir`, then `subdir` itself
        (local roots; object stores hold a value once its write returns)."""
        if self.local_root is None:
            return
        top = os.path.join(self.local_root, _check_relative(subdir, self.url))
        try:
            for dirpath, _, files in os.walk(top, topdown=False):
                for name in files:
                    _fsync_path(os.path.join(dirpath, name), os.O_RDONLY)
                _fsync_path(dirpath, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise CkptError(f"cannot write: {exc.strerror or exc}", self._where(subdir)) from exc

    def delete_all(self) -> None:
        """Remove every key under this root (used to drop an unfinished output)."""
        self._listing = None
        self.wait(self._kv.delete_range(ts.KvStore.KeyRange()), "cannot delete", self.url)

    # -- deadlines and errors --------------------------------------------------
    @property
    def endpoint(self) -> str | None:
        """The remote endpoint (s3://, gs://), or None for local and memory stores."""
        return self._endpoint

    def wait(self, future: Any, what: str, where: str, *, nbytes: int = 0) -> Any:
        """`future.result()` under this store's deadline (remote stores), failures as one line.

        For tensorstore calls made outside this module (array opens and reads):
        a failure is a CkptError `<where>: <what>: ...`; a remote endpoint that
        does not answer is a StorageUnavailableError naming it. `nbytes`: what
        the operation moves, which extends the deadline.
        """
        try:
            return _wait_for(future, self._endpoint, nbytes, what, where)
        except CkptError:
            raise
        except Exception as exc:
            raise self._error(exc, what, where) from exc

    def _wait(self, future: Any, nbytes: int, what: str, where: str) -> Any:
        """As wait(), but tensorstore's own exceptions pass through (callers that read their status)."""
        return _wait_for(future, self._endpoint, nbytes, what, where)

    def _error(self, exc: BaseException, what: str, where: str) -> CkptError:
        return _error_for(exc, self._endpoint, what, where)

    # -- internals -------------------------------------------------------
    def _where(self, key: str) -> str:
        return f"{self.url}/{key}"

    def _checked(self, key: str) -> str:
        rel = _check_relative(key, self.url)
        if not rel:
            raise CkptError("empty key", self.url)
        if self._check_local:
            self._check_local_path(rel, want_dir=False)
        return rel

    def _check_local_path(self, rel: str, *, want_dir: bool) -> None:
        """Refuse symlinks leading out of the root and anything but files/dirs."""
        root = os.path.realpath(self.local_root)  # type: ignore[arg-type]
        path = os.path.join(self.local_root, rel)  # type: ignore[arg-type]
        real = os.path.realpath(path)
        if real != root and not real.startswith(root + os.sep):
            raise PathEscapeError(f"{rel!r} resolves to {real}, outside the checkpoint", self.url)
        try:
            st = os.stat(real)
        except FileNotFoundError:
            return  # reported as missing by the read itself
        except OSError as exc:
            raise _os_error(exc, "cannot stat", self._where(rel)) from None
        if want_dir:
            if not stat.S_ISDIR(st.st_mode):
                raise NotFoundError("not a directory", self._where(rel))
        elif not stat.S_ISREG(st.st_mode):
            raise PathEscapeError("not a regular file (refusing to open a FIFO, device or socket)", self._where(rel))

    def _read(self, key: str, byte_range: slice | None) -> bytes:
        if byte_range is not None and self._check_local:
            return self._pread_local(key, byte_range.start, byte_range.stop)
        if self._check_local:
            return self._read_whole_local(key)
        rel = self._checked(key)
        self.log.record(rel)
        try:
            if byte_range is None:
                fut = self._kv.read(rel)
            else:
                fut = self._kv.read(rel, byte_range=byte_range)
            res = self._wait(fut, 0 if byte_range is None else byte_range.stop - byte_range.start, "cannot read", self._where(rel))
        except ValueError as exc:
            msg = str(exc)
            if "OUT_OF_RANGE" in msg:
                m = _SIZE_IN_ERROR.search(msg)
                have = f"it has {m.group(1)} bytes" if m else "it is shorter"
                raise CkptError(
                    f"truncated: needed bytes [{byte_range.start}, {byte_range.stop}) but {have}",  # type: ignore[union-attr]
                    self._where(rel),
                ) from exc
            raise self._error(exc, "cannot read", self._where(rel)) from exc
        if res.state != "value":
            raise NotFoundError("missing", self._where(rel))
        return bytes(res.value)


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
        raise _note_unavailable(
            f"{what}: storage endpoint {endpoint} gave no answer within {timeout:g} s (CKPT_IO_TIMEOUT)", where, endpoint
        ) from None


def _error_for(exc: BaseException, endpoint: str | None, what: str, where: str) -> CkptError:
    """A tensorstore failure as one line: no answer from a remote endpoint, a symlink loop, or its own text."""
    text = _text(exc)
    if endpoint is not None and _TRANSPORT.search(text):
        return _note_unavailable(f"{what}: {_transport_detail(text, endpoint)}", where, endpoint)
    if "Too many levels of symbolic links" in text:
        return PathEscapeError("symlink loop (Too many levels of symbolic links)", where)
    past_end = _past_end(text)
    if past_end is not None:  # the file that is short, named as validate names it
        message, path = past_end
        return CkptError(message, _object_url(path, where))
    denied = _denied(text, where) if endpoint is not None else None
    if denied is not None:
        if _credentials_hint(where):
            # no credentials at all: every request will be refused alike, so this
            # is the run's one error (validate too), not a finding per file
            return _note_unavailable(f"{what}: {denied}", where, endpoint)
        return CkptError(f"{what}: {denied}", where)
    return CkptError(f"{what}: {text}", where)


def _fsync_path(path: str, flags: int) -> None:
    fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _text(exc: BaseException) -> str:
    text = str(exc).split(" [source locations=", 1)[0].split(" [tensorstore_spec=", 1)[0]
    return text.splitlines()[0] if text else type(exc).__name__


def _os_error(exc: OSError, what: str, where: str) -> CkptError:
    """An OS error on a local path as one line (a symlink loop is a containment failure)."""
    if exc.errno == errno.ELOOP:
        return PathEscapeError("symlink loop (Too many levels of symbolic links)", where)
    return CkptError(f"{what}: {exc.strerror or exc}", where)


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
        message, path = past_end
        return f"{_object_url(path, _LAST_REMOTE_URL) if _LAST_ENDPOINT else path}: {message}"
    denied = _denied(text, _LAST_SCHEME) if _LAST_ENDPOINT is not None else None
    if denied is not None and _credentials_hint(_LAST_SCHEME):
        _note_unavailable(denied, None, _LAST_ENDPOINT)  # no credentials: the run's one error
    return denied or text
