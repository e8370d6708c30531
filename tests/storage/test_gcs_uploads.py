"""Whole objects written to gs:// go by ckpt's own media POSTs (storage/gcs_uploads.py, issue 43).

tensorstore's gcs driver copies a value into a Cord before curl copies it again, and its answer's
crc32c never reaches ckpt, which then asked for each object's crc32c by a second request. ckpt now
uploads from its own buffer and checks the crc32c and size of the upload's answer; anything
unexpected is uploaded again through tensorstore, whose errors ckpt words as before.

Against the real GCS server (the Go fake-gcs-server), behind a small HTTP front that records each
request with its User-Agent (curl's names tensorstore; http.client sends none) and can answer in
its place: a 503, a wrong crc32c, a refusal, or nothing at all. Each command runs in a process of
its own (tensorstore keeps the first GCS endpoint a process uses).
"""
from __future__ import annotations

import base64
import json
import threading
import time
import urllib.parse
import urllib.request
from typing import Any, Iterator

import pytest

from conftest import fake_gcs_serving, fixture_path, gcs_create_bucket, run_ckpt
from http_front import HttpFront, by_tensorstore

pytestmark = pytest.mark.slow

BUCKET = "ckpt-gcs-uploads"
DCP = str(fixture_path("dcp_single"))
ORBAX = str(fixture_path("flax_orbax"))
OWNER = ".ckpt-owner.json"


class Front(HttpFront):
    """The HTTP front of tests/http_front.py with a `fault(method, target, by_tensorstore)` each test
    may set: None forwards, "hang" never answers, (status, body) answers that, and ("crc", None)
    forwards but changes the crc32c of the answer."""

    def __init__(self, upstream: str) -> None:
        self.fault: Any = lambda method, target, ts: None
        self._asked = threading.local()  # this request's fault (a request is answered on one thread)
        super().__init__(upstream, answer=self._answer, rewrite=self._rewrite)

    def _answer(self, method: str, target: str, headers: dict[str, str]) -> Any:
        fault = self._asked.fault = self.fault(method, target, by_tensorstore(headers))
        return None if fault is not None and fault[0] == "crc" else fault

    def _rewrite(self, method: str, target: str, headers: dict[str, str], data: bytes) -> bytes:
        if self._asked.fault is None:
            return data
        doc = json.loads(data)  # ("crc", None): the answer claims another crc32c
        crc = int.from_bytes(base64.b64decode(doc["crc32c"]), "big") ^ 1
        doc["crc32c"] = base64.b64encode(crc.to_bytes(4, "big")).decode()
        return json.dumps(doc).encode()

    @property
    def requests(self) -> list[tuple[str, str, bool]]:
        """(method, target, by tensorstore) of every request, in order."""
        return [(r["method"], r["path"], r["by_tensorstore"]) for r in self.records]

    def uploads(self, prefix: str) -> list[tuple[str, bool]]:
        """(object name, by tensorstore) of every media upload under `prefix`, in order."""
        out = []
        for method, target, ts in self.requests:
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query)
            if method == "POST" and query.get("uploadType") == ["media"] and query["name"][0].startswith(prefix):
                out.append((query["name"][0], ts))
        return out


@pytest.fixture(scope="module")
def gcs() -> Iterator[dict[str, str]]:
    with fake_gcs_serving() as env:
        gcs_create_bucket(env["CKPT_TEST_GCS"], BUCKET)
        yield env


@pytest.fixture
def front(gcs) -> Iterator[Front]:
    f = Front(gcs["CKPT_TEST_GCS"])
    yield f
    f.close()


def _env(gcs: dict[str, str], front: Front, **extra: str) -> dict[str, str]:
    return {**gcs, "TENSORSTORE_GCS_HTTP_URL": front.url, **extra}


def _objects(endpoint: str, prefix: str) -> dict[str, bytes]:
    q = urllib.parse.urlencode({"prefix": prefix})
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o?{q}", timeout=60) as r:
        names = [item["name"] for item in json.load(r).get("items", [])]
    out = {}
    for name in names:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(name, safe='')}?alt=media",
                                    timeout=60) as r:
            out[name[len(prefix):]] = r.read()
    return out


@pytest.mark.parametrize("direct", ["1", "0"], ids=["direct", "tensorstore"])
def test_dcp_objects_are_uploaded_by_ckpts_own_requests_and_equal_tensorstores(gcs, front, direct):
    prefix = f"dcp-{direct}/"
    r = run_ckpt("convert", DCP, f"gs://{BUCKET}/{prefix}out", "--to", "dcp",
                 env=_env(gcs, front, CKPT_GCS_DIRECT_UPLOADS=direct))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    uploads = front.uploads(prefix)
    data = [(n, ts) for n, ts in uploads if not n.endswith(OWNER)]
    assert any(n.endswith("/.metadata") for n, _ in data) and any(n.endswith(".distcp") for n, _ in data), uploads
    # every object but the owner record (its create-once write stays with tensorstore) by ckpt's
    # own request, once each; with the switch off, by tensorstore's
    assert all(ts == (direct == "0") for _, ts in data), uploads
    assert len({n for n, _ in data}) == len(data), uploads
    assert [ts for n, ts in uploads if n.endswith(OWNER)] == [True], uploads
    if direct == "1":  # the crc32c came with the upload's answer: never asked for again
        assert not [t for m, t, _ in front.requests if m == "GET" and "fields=crc32c" in t], front.requests
    assert run_ckpt("validate", "--deep", f"gs://{BUCKET}/{prefix}out", env=gcs).returncode == 0


def test_dcp_and_orbax_outputs_are_equal_with_the_switch_on_and_off(gcs, front):
    """The same objects, of the same sizes, holding the same values: the bytes of two runs differ
    either way (a DCP data file's tensors come in the order the copy threads finish them; Orbax
    data files are named at random, and the OCDBT nodes name them)."""
    for kind, argv in (("dcp", ["convert", DCP, "{dst}", "--to", "dcp"]),
                       ("orbax", ["reshard", ORBAX, "{dst}", "--mesh", "data=2", "--devices", "2"])):
        outs = {}
        for direct in ("1", "0"):
            prefix = f"equal-{kind}-{direct}/"
            r = run_ckpt(*[a.format(dst=f"gs://{BUCKET}/{prefix}out") for a in argv],
                         env=_env(gcs, front, CKPT_GCS_DIRECT_UPLOADS=direct))
            assert r.returncode == 0, r.stderr
            outs[direct] = _objects(gcs["CKPT_TEST_GCS"], prefix)
        on, off = outs["1"], outs["0"]
        assert len(on) == len(off) >= 2
        assert sorted(map(len, on.values())) == sorted(map(len, off.values()))
        named = {k for k in on if "/d/" not in k}
        assert named == {k for k in off if "/d/" not in k}
        r = run_ckpt("diff", "--values", f"gs://{BUCKET}/equal-{kind}-1/out", f"gs://{BUCKET}/equal-{kind}-0/out",
                     env=gcs)
        assert r.returncode == 0, (r.stdout, r.stderr)


def test_a_wrong_crc32c_in_the_answer_is_one_line_and_nothing_commits(gcs, front):
    front.fault = lambda m, t, ts: ("crc", None) if m == "POST" and not ts and "distcp" in t else None
    dst = f"gs://{BUCKET}/wrong-crc/out"
    r = run_ckpt("convert", DCP, dst, "--to", "dcp", env=_env(gcs, front))
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ckpt: error: {dst}/__0_0.distcp: upload corrupted: GCS stored crc32c "), lines[0]
    assert ", ckpt sent crc32c " in lines[0]
    assert "wrong-crc/out/.metadata" not in _objects(gcs["CKPT_TEST_GCS"], "wrong-crc/")
    assert run_ckpt("validate", dst, env=gcs).returncode != 0


def test_a_503_is_retried_then_the_upload_goes_through(gcs, front):
    refused: list[str] = []

    def fault(m: str, t: str, ts: bool) -> Any:
        if m == "POST" and not ts and "distcp" in t and len(refused) < 2:
            refused.append(t)
            return 503, b'{"error": {"code": 503}}'
        return None

    front.fault = fault
    prefix = "retried/"
    r = run_ckpt("convert", DCP, f"gs://{BUCKET}/{prefix}out", "--to", "dcp", env=_env(gcs, front))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert len(refused) == 2
    # the third attempt was ckpt's own too: no fallback to tensorstore
    distcp = [(n, ts) for n, ts in front.uploads(prefix) if n.endswith(".distcp")]
    assert len(distcp) == 3 and not any(ts for _, ts in distcp), distcp


def test_a_503_every_time_is_one_line_after_the_retries(gcs, front):
    front.fault = lambda m, t, ts: (503, b"{}") if m == "POST" and not ts and "distcp" in t else None
    dst = f"gs://{BUCKET}/always-503/out"
    r = run_ckpt("convert", DCP, dst, "--to", "dcp", env=_env(gcs, front, CKPT_IO_RETRIES="2"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0] == (f"ckpt: error: {dst}/__0_0.distcp: cannot write: HTTP 503 from {front.url}; gave up after "
                        "2 attempts (CKPT_IO_RETRIES)"), lines[0]
    assert run_ckpt("validate", dst, env=gcs).returncode != 0


def test_an_unexpected_answer_falls_back_to_tensorstore(gcs, front):
    """A status ckpt does not expect (here 400 to its own uploads only): the object is uploaded
    through tensorstore instead, and the run succeeds."""
    front.fault = lambda m, t, ts: (400, b'{"error": {"code": 400}}') if m == "POST" and not ts else None
    prefix = "fallback/"
    r = run_ckpt("convert", DCP, f"gs://{BUCKET}/{prefix}out", "--to", "dcp", env=_env(gcs, front))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    uploads = [(n, ts) for n, ts in front.uploads(prefix) if not n.endswith(OWNER)]
    for name in {n for n, _ in uploads}:
        assert [ts for n, ts in uploads if n == name] == [False, True], uploads
    assert run_ckpt("validate", "--deep", f"gs://{BUCKET}/{prefix}out", env=gcs).returncode == 0


def test_an_upload_with_no_answer_is_one_line_within_the_deadline(gcs, front):
    front.fault = lambda m, t, ts: "hang" if m == "POST" and not ts and "distcp" in t else None
    dst = f"gs://{BUCKET}/hang/out"
    t = time.monotonic()
    r = run_ckpt("convert", DCP, dst, "--to", "dcp", env=_env(gcs, front, CKPT_IO_TIMEOUT="2"))
    assert time.monotonic() - t < 25
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"cannot write: storage endpoint {front.url} gave no answer within " in lines[0], lines[0]
    assert "(CKPT_IO_TIMEOUT)" in lines[0]
    assert "hang/out/.metadata" not in _objects(gcs["CKPT_TEST_GCS"], "hang/")
