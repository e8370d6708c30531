"""What GCS stored of an upload, checked against what ckpt sent: its CRC-32C and its size.

tensorstore's `gcs` driver (kvstore/gcs_http, 0.1.86 and its current source) uploads a value as one
`uploadType=media` POST with no `x-goog-hash` and no checksum in metadata, so GCS cannot refuse a
body damaged on the way; the object metadata its answer carries (crc32c included) is parsed for the
generation alone, and its Python API returns only that. Its reads compare no checksum either. So
after each upload ckpt asks GCS for the object's `crc32c` and `size` (one JSON-API `objects.get`
with `fields=`, a few hundred bytes) and compares them with the CRC-32C it computed of the bytes
it sent. A difference is one line naming the object and both checksums: the write fails, so the
run fails before its next commit marker, and removes what it wrote as any failed run does
(ops/destination_remote.py: the markers first, also one whose own upload was the damaged one).

The request goes where tensorstore's went (TENSORSTORE_GCS_HTTP_URL, else storage.googleapis.com)
with a token found the way tensorstore finds its own (google_auth_provider.cc): the
GOOGLE_AUTH_TOKEN_FOR_TESTING token; else the JSON file GOOGLE_APPLICATION_CREDENTIALS names, or
gcloud's application-default credentials (an `authorized_user` refresh token, exchanged over
plain HTTPS; a `service_account` key, signed with the `cryptography` package when it is
installed); else the metadata server of a GCE or TPU VM (GCE_METADATA_ROOT moves it); else no
token, as tensorstore then reads anonymously. No Google client library is needed for any of them.
CKPT_VERIFY_UPLOADS=0 turns the check off.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import threading
import time
import urllib.parse
from typing import Any

from ..base.errors import CkptError
from .kept_alive import KeptAlive

_TOKEN_FOR_TESTING = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
_SCOPE = "https://www.googleapis.com/auth/cloud-platform"
_REFRESH_URL = "https://www.googleapis.com/oauth2/v3/token"  # tensorstore's kOAuthV3Url
_SERVICE_ACCOUNT_URL = "https://www.googleapis.com/oauth2/v4/token"  # its kOAuthV4Url
_TIMEOUT = 30.0


def enabled() -> bool:
    """Whether uploads to gs:// are checked (CKPT_VERIFY_UPLOADS=0 turns it off)."""
    return os.environ.get("CKPT_VERIFY_UPLOADS", "1").strip().lower() not in ("0", "false", "no", "off")


def _hex(crc: int) -> str:
    return f"{crc:08x}"


# -- credentials, found as tensorstore finds them -------------------------------------------------


class _Token:
    """A bearer token for the JSON API, fetched once and refreshed a minute before it expires."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: str | None = None
        self._expires = 0.0
        self._anonymous = False

    def header(self) -> dict[str, str]:
        with self._lock:
            if self._anonymous:
                return {}
            if self._value is None or time.time() > self._expires - 60:
                token = _find_token()
                if token is None:
                    self._anonymous = True
                    return {}
                self._value, lifetime = token
                self._expires = time.time() + lifetime
            return {"Authorization": f"Bearer {self._value}"}


def _credentials_file() -> str | None:
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if named:
        return named
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(os.path.expanduser("~"), ".config", "gcloud")
    well_known = os.path.join(config, "application_default_credentials.json")
    return well_known if os.path.isfile(well_known) else None


def _find_token() -> tuple[str, float] | None:
    """(token, seconds it lives), or None for anonymous access (tensorstore's order)."""
    fixed = os.environ.get(_TOKEN_FOR_TESTING)
    if fixed:
        return fixed, 1e9
    path = _credentials_file()
    if path is not None:
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise CkptError(f"cannot read the credentials file to verify uploads: {exc}", path) from None
        if isinstance(doc, dict) and doc.get("refresh_token"):
            return _token_answer(_post_form(_REFRESH_URL, {
                "grant_type": "refresh_token", "client_id": doc.get("client_id", ""),
                "client_secret": doc.get("client_secret", ""), "refresh_token": doc["refresh_token"]}), path)
        if isinstance(doc, dict) and doc.get("private_key") and doc.get("client_email"):
            return _token_answer(_post_form(_SERVICE_ACCOUNT_URL, {
                "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
                "assertion": _signed_assertion(doc, path)}), path)
        raise CkptError("unexpected content of the credentials file (neither a refresh token nor a service-account "
                        "key)", path)
    return _metadata_server_token()


def _metadata_server_token() -> tuple[str, float] | None:
    """The VM's service-account token from the metadata server; None when not on GCE/TPU."""
    host = os.environ.get("GCE_METADATA_ROOT", "metadata.google.internal")
    try:
        conn = http.client.HTTPConnection(host, timeout=5)
        conn.request("GET", "/computeMetadata/v1/instance/service-accounts/default/token",
                     headers={"Metadata-Flavor": "Google"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except OSError:
        return None
    if resp.status != 200:
        return None
    return _token_answer(body, f"http://{host}")


def _token_answer(body: bytes, where: str) -> tuple[str, float]:
    try:
        doc = json.loads(body)
        return str(doc["access_token"]), float(doc.get("expires_in", 3600))
    except (ValueError, KeyError, TypeError):
        raise CkptError("no access token in the answer of the token endpoint (needed to verify uploads)",
                        where) from None


def _post_form(url: str, form: dict[str, str]) -> bytes:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPSConnection(parts.netloc, timeout=_TIMEOUT)
    try:
        conn.request("POST", parts.path, body=urllib.parse.urlencode(form),
                     headers={"Content-Type": "application/x-www-form-urlencoded"})
        resp = conn.getresponse()
        body = resp.read()
    except OSError as exc:
        raise CkptError(f"cannot get a token to verify uploads: {exc}", url) from None
    finally:
        conn.close()
    if resp.status != 200:
        raise CkptError(f"cannot get a token to verify uploads: HTTP {resp.status}", url)
    return body


def _signed_assertion(key: dict[str, Any], path: str) -> str:
    """A service account's JWT bearer assertion, signed RS256 (as tensorstore's provider signs it)."""
    try:
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import padding, rsa
    except ImportError:
        raise CkptError("verifying uploads to gs:// with a service-account key needs the `cryptography` package "
                        "(pip install cryptography), or CKPT_VERIFY_UPLOADS=0 to skip the check", path) from None

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")

    now = int(time.time())
    header = b64(json.dumps({"alg": "RS256", "typ": "JWT"}).encode())
    claims = b64(json.dumps({"iss": key["client_email"], "scope": _SCOPE, "aud": _SERVICE_ACCOUNT_URL,
                             "iat": now, "exp": now + 3600}).encode())
    try:
        private = serialization.load_pem_private_key(key["private_key"].encode(), password=None)
    except ValueError as exc:
        raise CkptError(f"cannot load the service-account key to verify uploads: {exc}", path) from None
    if not isinstance(private, rsa.RSAPrivateKey):
        raise CkptError("the service-account key is not an RSA key (cannot sign a token to verify uploads)", path)
    signature = private.sign(f"{header}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
    return f"{header}.{claims}.{b64(signature)}"


_token = _Token()


# -- the object's metadata ------------------------------------------------------------------------

# kept-alive connections not in use, per (scheme, host): any thread takes one (writers' threads come
# and go; a TLS handshake per object would cost GCS two more round trips)
_pool = KeptAlive()
# the answers a request to GCS is retried after (with backoff, CKPT_IO_RETRIES attempts)
RETRIED_STATUSES = (408, 429, 500, 502, 503, 504)


def _endpoint() -> str:
    return os.environ.get("TENSORSTORE_GCS_HTTP_URL") or "https://storage.googleapis.com"


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    key = (parts.scheme, parts.netloc)
    path = parts.path + ("?" + parts.query if parts.query else "")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    for fresh in (False, True):  # a kept-alive connection the server closed meanwhile: once more on a new one
        conn, _reused = _pool.take(key, lambda: cls(parts.netloc, timeout=timeout), None, fresh=fresh)
        try:
            conn.request("GET", path, headers=_token.header())
            resp = conn.getresponse()
            answer = resp.status, resp.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if fresh:
                raise
            continue
        except OSError:
            conn.close()
            raise
        if resp.will_close:  # (the server ends the connection after this answer)
            conn.close()
        else:
            _pool.give(key, conn)
        return answer
    raise AssertionError("unreachable")


def stored(bucket: str, name: str, where: str) -> tuple[int | None, int]:
    """(CRC-32C, size) GCS holds for object `name` in `bucket` (CRC None when it keeps none)."""
    from .remote import IO_RETRIES, IO_TIMEOUT

    url = (f"{_endpoint()}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/"
           f"{urllib.parse.quote(name, safe='')}?fields=crc32c%2Csize%2Cgeneration")
    delay = 0.25
    for attempt in range(1, IO_RETRIES + 1):
        try:
            status, body = _get(url, IO_TIMEOUT)
        except OSError as exc:
            if attempt == IO_RETRIES:
                raise CkptError(f"cannot verify the upload: {_endpoint()} does not answer ({exc}); gave up after "
                                f"{IO_RETRIES} attempts (CKPT_IO_RETRIES)", where) from None
        else:
            if status == 200:
                break
            if status == 404:
                raise CkptError("uploaded, but GCS has no such object when asked for its checksum", where)
            if status in (401, 403):
                raise CkptError(f"cannot verify the upload: access denied (HTTP {status}) reading its metadata", where)
            if status not in RETRIED_STATUSES or attempt == IO_RETRIES:
                raise CkptError(f"cannot verify the upload: HTTP {status} reading its metadata", where)
        time.sleep(delay)
        delay = min(2.0, delay * 2)
    try:
        doc = json.loads(body)
        crc = doc.get("crc32c")
        return (None if crc is None else int.from_bytes(base64.b64decode(crc), "big")), int(doc["size"])
    except (ValueError, KeyError, TypeError):
        raise CkptError("cannot verify the upload: GCS answered with no size for the object", where) from None


def check(bucket: str, name: str, sent_crc: int, sent_size: int, where: str) -> None:
    """Raise one line naming `where` and both checksums unless GCS holds what was sent."""
    crc, size = stored(bucket, name, where)
    if crc is None:  # (GCS keeps one for every object; a stand-in server may not)
        raise CkptError(f"cannot verify the upload: {_endpoint()} reports no crc32c for it "
                        "(CKPT_VERIFY_UPLOADS=0 skips the check)", where)
    if crc == sent_crc and size == sent_size:
        return
    raise CkptError(f"upload corrupted: GCS stored crc32c {_hex(crc)} ({size} bytes), ckpt sent crc32c "
                    f"{_hex(sent_crc)} ({sent_size} bytes)", where)
