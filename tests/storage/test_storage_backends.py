"""Every kind of storage passes the one backend suite (tests/storage_suite.py).

Each class populates its kind of root by other means than the Storage under test: the file system,
tensorstore's memory kvstore, boto3 against a real moto server, the GCS JSON API of a real
gcp-storage-emulator, tensorstore's OCDBT driver, or a committed Orbax checkpoint.
"""
from __future__ import annotations

import json
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest
import tensorstore as ts

from conftest import fixture_path, gcs_emulator_serving, moto_s3_serving, s3_client
from storage_suite import TREE, BackendTests, Populated

from ckpt_tool.storage import Storage


def _write_tree(root: Path, contents: dict[str, bytes]) -> None:
    for key, value in contents.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(value)


class TestLocal(BackendTests):
    @pytest.fixture
    def populated(self, tmp_path: Path) -> Populated:
        root = tmp_path / "ckpt"
        _write_tree(root, TREE)
        return Populated(Storage.open(str(root)), dict(TREE), root)


class TestLocalFileUrl(BackendTests):
    @pytest.fixture
    def populated(self, tmp_path: Path) -> Populated:
        root = tmp_path / "ckpt"
        _write_tree(root, TREE)
        return Populated(Storage.open("file://" + str(root)), dict(TREE), root)


class TestMemory(BackendTests):
    @pytest.fixture
    def populated(self) -> Populated:
        path = f"suite-{uuid.uuid4().hex}"
        # memory:// stores are shared within the process through the storage layer's one context
        from ckpt_tool.storage import _CONTEXT

        kv = ts.KvStore.open({"driver": "memory", "path": path + "/"}, context=_CONTEXT).result()
        for key, value in TREE.items():
            kv.write(key, value).result()
        return Populated(Storage.open(f"memory://{path}"), dict(TREE))


# -- object stores on real servers on 127.0.0.1 ------------------------------------------

S3_BUCKET = "ckpt-suite"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[dict[str, str]]:
    with moto_s3_serving(S3_BUCKET, []) as env:
        # CKPT_DEBUG keeps this process's fd 2 as it is (no native-log filter under pytest's capture)
        yield {**env, "CKPT_DEBUG": "1"}


class TestS3(BackendTests):
    @pytest.fixture
    def populated(self, s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Populated:
        for name, setting in s3_server.items():
            monkeypatch.setenv(name, setting)
        prefix = f"suite-{uuid.uuid4().hex}"  # each test its own root: writes stay its own
        s3 = s3_client(s3_server["AWS_ENDPOINT_URL"])
        for key, value in TREE.items():
            s3.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{key}", Body=value)
        return Populated(Storage.open(f"s3://{S3_BUCKET}/{prefix}"), dict(TREE))


def _gcs_post(endpoint: str, path: str, data: bytes, content_type: str = "application/octet-stream") -> None:
    req = urllib.request.Request(f"{endpoint}{path}", data=data, method="POST", headers={"Content-Type": content_type})
    with urllib.request.urlopen(req, timeout=10):
        pass


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[str]:
    with gcs_emulator_serving() as endpoint:
        yield endpoint


class TestGcs(BackendTests):
    @pytest.fixture
    def populated(self, gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> Populated:
        # GOOGLE_AUTH_TOKEN_FOR_TESTING: tensorstore skips its credentials search (no metadata server)
        for name, setting in {"TENSORSTORE_GCS_HTTP_URL": gcs_server, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
                            "GCE_METADATA_ROOT": "127.0.0.1:9", "CKPT_DEBUG": "1"}.items():
            monkeypatch.setenv(name, setting)
        # a bucket per test: the emulator lists by prefix only, ignoring the key range asked for
        bucket = f"suite-{uuid.uuid4().hex[:16]}"
        _gcs_post(gcs_server, "/storage/v1/b?project=test", json.dumps({"name": bucket}).encode(), "application/json")
        for key, value in TREE.items():
            query = urllib.parse.urlencode({"uploadType": "media", "name": f"ckpt/{key}"})
            _gcs_post(gcs_server, f"/upload/storage/v1/b/{bucket}/o?{query}", value)
        return Populated(Storage.open(f"gs://{bucket}/ckpt"), dict(TREE))


# -- OCDBT views --------------------------------------------------------------------------

def _ocdbt_contents(db: Path) -> dict[str, bytes]:
    """Every key of the OCDBT database in `db` and its value, by tensorstore's own point reads."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(db) + "/"}}).result()
    return {k.decode(): bytes(kv.read(k).result().value) for k in kv.list().result()}


class TestOcdbtView(BackendTests):
    """A database tensorstore writes with small values in line and large ones in data files."""

    @pytest.fixture
    def populated(self, tmp_path: Path) -> Populated:
        db = tmp_path / "db"
        kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": str(db) + "/"},
                              "config": {"max_inline_value_bytes": 64}}).result()
        txn = ts.Transaction()
        for key, value in TREE.items():
            kv.with_transaction(txn)[key] = value
        txn.commit_async().result()
        return Populated(Storage.open(str(db)).ocdbt(), dict(TREE))


class TestOrbaxOcdbtView(BackendTests):
    """The database of a committed Orbax checkpoint (fixtures/orbax_ocdbt_zarr2), read as a directory."""

    @pytest.fixture
    def populated(self) -> Populated:
        root = fixture_path("orbax_ocdbt_zarr2")
        return Populated(Storage.open(str(root)).ocdbt(), _ocdbt_contents(root))


class TestOrbaxOcdbtViewOnS3(BackendTests):
    """The same database uploaded to S3: the view over a remote root has its deadlines."""

    @pytest.fixture
    def populated(self, s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Populated:
        for name, setting in s3_server.items():
            monkeypatch.setenv(name, setting)
        root = fixture_path("orbax_ocdbt_zarr2")
        prefix = f"suite-{uuid.uuid4().hex}"
        s3 = s3_client(s3_server["AWS_ENDPOINT_URL"])
        for path in root.rglob("*"):
            if path.is_file():
                s3.put_object(Bucket=S3_BUCKET, Key=f"{prefix}/{path.relative_to(root)}", Body=path.read_bytes())
        return Populated(Storage.open(f"s3://{S3_BUCKET}/{prefix}").ocdbt(), _ocdbt_contents(root))

