"""Uploads to gs:// are checked against what GCS stored (issue 43 item 5: "crc32c for GCS").

tensorstore's gcs driver uploads with no checksum (no `x-goog-hash`), so GCS stores whatever body
reaches it. These tests put a TCP proxy between ckpt and the real fake-gcs-server that flips one
byte in the body of a chosen upload, as a bad NIC or middlebox would: GCS then stores (and
reports the crc32c of) bytes ckpt never sent. ckpt must say so in one line naming the object and
both checksums, exit 1, and leave nothing that validates as complete, whether the upload was ckpt's
own (gcs_uploads.py, the crc32c of its answer) or tensorstore's (CKPT_GCS_DIRECT_UPLOADS=0, the
crc32c asked for once after it).
"""
from __future__ import annotations

import json
import socket
import threading
import urllib.parse
import urllib.request
from typing import Callable

import pytest

from conftest import fake_gcs_serving, fixture_path, gcs_create_bucket, run_ckpt
from http_front import HttpFront

pytestmark = pytest.mark.slow

BUCKET = "ckpt-checksums"
SRC = str(fixture_path("dcp_single"))


class CorruptingProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` (host:port) that flips the first body byte of
    every HTTP request whose request line `corrupt` selects, and records every request line."""

    def __init__(self, target: str, corrupt: Callable[[str], bool]) -> None:
        host, port = target.split(":")
        self.target = (host, int(port))
        self.corrupt = corrupt
        self.requests: list[str] = []
        self.agents: list[str] = []  # each request's User-Agent (curl's names tensorstore; http.client sends none)
        self.flipped: list[str] = []
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._requests, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _requests(self, src: socket.socket, dst: socket.socket) -> None:
        """Forward HTTP/1.1 requests one after another (headers, then Content-Length body bytes)."""
        head, remaining, flip = b"", 0, False
        try:
            while data := src.recv(1 << 16):
                while data:
                    if remaining:
                        piece, data = data[:remaining], data[remaining:]
                        if flip:
                            piece, flip = bytes([piece[0] ^ 0x01]) + piece[1:], False
                        dst.sendall(piece)
                        remaining -= len(piece)
                        continue
                    head += data
                    data = b""
                    if b"\r\n\r\n" not in head:
                        break
                    head, data = head.split(b"\r\n\r\n", 1)
                    lines = head.decode("latin-1").split("\r\n")
                    length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                                   if k.strip().lower() == "content-length"), 0)
                    dst.sendall(head + b"\r\n\r\n")
                    with self._lock:
                        self.requests.append(lines[0])
                        self.agents.append(next((v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
                                                 if k.strip().lower() == "user-agent"), ""))
                        flip = length > 0 and self.corrupt(lines[0])
                        if flip:
                            self.flipped.append(lines[0])
                    head, remaining = b"", length
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture(scope="module")
def gcs():
    with fake_gcs_serving() as env:
        gcs_create_bucket(env["CKPT_TEST_GCS"], BUCKET)
        yield env


def _keys(endpoint: str, prefix: str) -> list[str]:
    q = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=60) as r:
        return sorted(item["name"] for item in json.load(r).get("items", []))


def _through(gcs: dict, proxy: CorruptingProxy) -> dict:
    return {**gcs, "TENSORSTORE_GCS_HTTP_URL": proxy.url}


def _uploaded(request_line: str) -> str | None:
    """The object name of an upload request line (tensorstore's `uploadType=media` POST), else None."""
    method, target, _ = request_line.split(" ", 2)
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
    if method != "POST" or query.get("uploadType") != ["media"]:
        return None
    return query["name"][0]


def _upload_of(suffix: str) -> Callable[[str], bool]:
    return lambda line: (_uploaded(line) or "").endswith(suffix)


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct-uploads", "tensorstore-uploads"])
def test_a_clean_upload_to_gs_is_checked_against_the_crc32c_gcs_stored(gcs, direct):
    """ckpt's own uploads (storage/gcs_uploads.py) compare the crc32c their answer carries: no
    second request. Through tensorstore (CKPT_GCS_DIRECT_UPLOADS=0), whose answer ckpt never sees,
    each object's crc32c is asked for once after its upload."""
    proxy = CorruptingProxy(urllib.parse.urlsplit(gcs["CKPT_TEST_GCS"]).netloc, lambda line: False)
    try:
        dst = f"gs://{BUCKET}/clean-{direct}/dcp"
        r = run_ckpt("convert", SRC, dst, "--to", "dcp", env={**_through(gcs, proxy), "CKPT_GCS_DIRECT_UPLOADS": direct})
        assert r.returncode == 0, r.stderr
        assert r.stderr == ""
        uploads = [n for n in map(_uploaded, proxy.requests) if n is not None]
        # every object ckpt uploaded from its own bytes (all but the owner record, whose JSON is
        # parsed where it is read, and whose create-once write stays with tensorstore)
        data = [n for n in uploads if not n.endswith("/.ckpt-owner.json")]
        assert f"clean-{direct}/dcp/.metadata" in data and len(data) >= 2, uploads
        for name in data:
            asked = [i for i, line in enumerate(proxy.requests)
                     if line.startswith(f"GET /storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?")
                     and "fields=crc32c" in line]
            upload = [i for i, line in enumerate(proxy.requests) if _uploaded(line) == name]
            by_tensorstore = ["tensorstore" in proxy.agents[i] for i in upload]
            if direct == "1":
                assert len(upload) == 1 and by_tensorstore == [False] and asked == [], (name, proxy.requests)
            else:
                assert by_tensorstore == [True] and len(asked) == 1 and asked[0] > upload[0], (name, asked, upload)
    finally:
        proxy.close()
    assert run_ckpt("validate", dst, env=gcs).returncode == 0


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct-uploads", "tensorstore-uploads"])
@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"], ids=["data-file", "commit-marker"])
def test_an_upload_corrupted_on_the_way_to_gs_is_one_line_and_nothing_commits(gcs, victim, direct):
    proxy = CorruptingProxy(urllib.parse.urlsplit(gcs["CKPT_TEST_GCS"]).netloc, _upload_of(f"/{victim}"))
    prefix = f"corrupt-{'marker' if victim == '.metadata' else 'data'}-{direct}/dcp"
    dst = f"gs://{BUCKET}/{prefix}"
    try:
        r = run_ckpt("convert", SRC, dst, "--to", "dcp", env={**_through(gcs, proxy), "CKPT_GCS_DIRECT_UPLOADS": direct})
    finally:
        proxy.close()
    assert proxy.flipped, proxy.requests  # the proxy did damage the upload
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ckpt: error: {dst}/{victim}: upload corrupted: GCS stored crc32c "), lines[0]
    assert ", ckpt sent crc32c " in lines[0], lines[0]
    # nothing commits: no DCP metadata is left, and what is there does not validate
    keys = _keys(gcs["CKPT_TEST_GCS"], f"{prefix}/")
    assert f"{prefix}/.metadata" not in keys, keys
    assert run_ckpt("validate", dst, env=gcs).returncode != 0


def test_a_refused_checksum_request_is_one_line_and_nothing_commits(gcs):
    """A token that may upload but not read an object's metadata: the upload cannot be verified,
    which fails the run (one line), never passes as verified. (Uploads through tensorstore: ckpt's
    own take the crc32c from the upload's answer and ask no more.)"""
    # the checksum request refused with 403; everything else forwarded to the server
    refuse = lambda method, path, headers: (403, b'{"error": {"code": 403}}') if "fields=crc32c" in path else None  # noqa: E731
    dst = f"gs://{BUCKET}/refused/dcp"
    with HttpFront(gcs["CKPT_TEST_GCS"], answer=refuse) as front:
        r = run_ckpt("convert", SRC, dst, "--to", "dcp", env={
            **gcs, "TENSORSTORE_GCS_HTTP_URL": front.url, "CKPT_GCS_DIRECT_UPLOADS": "0"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ckpt: error: {dst}/") and lines[0].endswith(
        ": cannot verify the upload: access denied (HTTP 403) reading its metadata"), lines[0]
    assert "refused/dcp/.metadata" not in _keys(gcs["CKPT_TEST_GCS"], "refused/dcp/")


def test_the_vm_metadata_server_token_is_used_as_tensorstore_uses_it(monkeypatch, tmp_path):
    """On a TPU or GCE VM with no credentials file, the check's token comes from the metadata
    server, as tensorstore's does (GCE_METADATA_ROOT points at a stand-in here)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from ckpt_tool.storage import gcs_verify

    seen: list[tuple[str, str | None]] = []

    class Metadata(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            seen.append((self.path, self.headers.get("Metadata-Flavor")))
            data = json.dumps({"access_token": "vm-token", "expires_in": 1800, "token_type": "Bearer"}).encode()
            ok = self.path == "/computeMetadata/v1/instance/service-accounts/default/token" \
                and self.headers.get("Metadata-Flavor") == "Google"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in ("GOOGLE_AUTH_TOKEN_FOR_TESTING", "GOOGLE_APPLICATION_CREDENTIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default credentials
    monkeypatch.setenv("GCE_METADATA_ROOT", f"127.0.0.1:{server.server_address[1]}")
    try:
        assert gcs_verify._find_token() == ("vm-token", 1800.0)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [("/computeMetadata/v1/instance/service-accounts/default/token", "Google")]


def test_a_service_account_key_signs_its_token_request(tmp_path):
    """A service-account key file (GOOGLE_APPLICATION_CREDENTIALS): the JWT assertion the token
    request carries is signed RS256 by that key, for the cloud-platform scope."""
    import base64

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import padding, rsa

    from ckpt_tool.storage import gcs_verify

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    doc = {"type": "service_account", "client_email": "ckpt@project.iam.gserviceaccount.com", "private_key": pem}
    header, claims, signature = gcs_verify._signed_assertion(doc, str(tmp_path / "sa.json")).split(".")

    def unb64(part: str) -> bytes:
        return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))

    key.public_key().verify(unb64(signature), f"{header}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
    assert json.loads(unb64(header)) == {"alg": "RS256", "typ": "JWT"}
    body = json.loads(unb64(claims))
    assert body["iss"] == doc["client_email"] and body["scope"] == "https://www.googleapis.com/auth/cloud-platform"
    assert body["aud"] == "https://www.googleapis.com/oauth2/v4/token" and body["exp"] - body["iat"] == 3600
