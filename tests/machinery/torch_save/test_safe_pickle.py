"""The allow-list unpickler: real DCP pickles load, hostile ones never run."""
from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tool.base.errors import CkptError, CorruptMetadataError, UnsafePickleError
from ckpt_tool.machinery.torch_save import safe_pickle
from ckpt_tool.machinery.torch_save import payload as torch_payload
from ckpt_tool.machinery.torch_save.safe_pickle import (
    BytesStorageMetadata,
    Metadata,
    TensorRef,
    TensorStorageMetadata,
    TorchDType,
    load_metadata,
    load_payload,
)

from conftest import DCP_FIXTURES, fixture_path, mutate_bytes

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

# one-process saves: torch warns that it assumes no process group
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def real_dcp(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("dcp") / "ckpt"
    state = {
        "w": torch.randn(3, 4),
        "h": torch.ones(2, dtype=torch.bfloat16),
        "f8": torch.zeros(3, dtype=torch.float8_e4m3fn),
        "u16": torch.arange(3, dtype=torch.int32).to(torch.uint16),
        "layers": [torch.zeros(2), 7],
        "cfg": {"lr": 0.1, "name": "x", "ids": (1, 2)},
    }
    dcp.save(state, checkpoint_id=str(path))
    return path


def _metadata_files(real_dcp: Path) -> list[Path]:
    files = [real_dcp / ".metadata"]
    files += [fixture_path(n) / ".metadata" for n in DCP_FIXTURES if (fixture_path(n) / ".metadata").exists()]
    return files


# -- real pickles ------------------------------------------------------------------
def test_real_metadata_loads_like_torch(real_dcp):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as TorchTSM

    for path in _metadata_files(real_dcp):
        ours = load_metadata(path.read_bytes(), str(path))
        theirs = FileSystemReader(str(path.parent)).read_metadata()
        assert isinstance(ours, Metadata)
        assert ours.version == theirs.version
        assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
        assert ours.planner_data == theirs.planner_data
        for fqn, item in theirs.state_dict_metadata.items():
            mine = ours.state_dict_metadata[fqn]
            if isinstance(item, TorchTSM):
                assert isinstance(mine, TensorStorageMetadata)
                assert tuple(mine.size) == tuple(item.size)
                assert mine.properties.dtype == TorchDType(str(item.properties.dtype).removeprefix("torch."))
                assert mine.properties.memory_format == "contiguous_format"
                assert mine.properties.layout == "torch.strided"
                assert [(tuple(c.offsets), tuple(c.sizes)) for c in mine.chunks] == [
                    (tuple(c.offsets), tuple(c.sizes)) for c in item.chunks
                ]
            else:
                assert isinstance(mine, BytesStorageMetadata)
        ours_storage = {
            (i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
            for i, s in ours.storage_data.items()
        }
        theirs_storage = {
            (i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
            for i, s in theirs.storage_data.items()
        }
        assert ours_storage == theirs_storage
        # checkpoint_id is a pathlib path in the pickle: it becomes a plain str
        assert ours.storage_meta.checkpoint_id == str(theirs.storage_meta.checkpoint_id)


def test_real_tensor_payloads_load(real_dcp):
    md = load_metadata((real_dcp / ".metadata").read_bytes(), "md")
    raw = (real_dcp / "__0_0.distcp").read_bytes()
    kinds = set()
    for index, info in md.storage_data.items():
        entry = raw[info.offset : info.offset + info.length]
        pkl = next(
            zipfile.ZipFile(io.BytesIO(entry)).read(n)
            for n in zipfile.ZipFile(io.BytesIO(entry)).namelist()
            if n.endswith("/data.pkl")
        )
        obj, storages = load_payload(pkl, index.fqn)
        if index.offset is not None:
            assert isinstance(obj, TensorRef) and list(storages) == [obj.storage.key]
            kinds.add("v3" if obj.storage.dtype is None else "v2")
        else:
            kinds.add(type(obj).__name__)
    assert {"v2", "v3", "int", "float", "str", "tuple"} <= kinds


def test_python_and_numpy_values_round_trip():
    value = {
        "bytes": b"\x00\xffab",
        "empty": b"",
        "ba": bytearray(b"xy"),
        "set": {1, 2},
        "fs": frozenset({"a"}),
        "c": 1 + 2j,
        "np_f": np.float64(2.5),
        "np_i": np.int32(-3),
        "np_a": np.arange(6, dtype=">i4").reshape(2, 3),
        "np_f_order": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "nested": [[1, (2, None)], {"k": True}],
    }
    for protocol in (2, 4):
        got, _ = load_payload(pickle.dumps(value, protocol=protocol), "mem")
        assert got.keys() == value.keys()
        for key in value:
            if isinstance(value[key], np.ndarray):
                np.testing.assert_array_equal(got[key], value[key])
                assert got[key].dtype == value[key].dtype
            else:
                assert got[key] == value[key] and type(got[key]) is type(value[key]), key


# -- hostile pickles -----------------------------------------------------------------
class _Reduce:
    """Pickles as a call of `fn(*args)`: what a hostile writer would produce."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _marker_command(marker: Path) -> str:
    return f"touch {marker}"


def _hostile(marker: Path) -> dict[tuple[str, str], list[bytes]]:
    """Pickles naming each dangerous global, in several protocols and spellings."""
    import builtins
    import importlib
    import subprocess

    cmd = _marker_command(marker)
    out: dict[tuple[str, str], list[bytes]] = {
        # os.system pickles as posix.system on Linux; a hand-made one names os
        ("os", "system"): [
            b"cos\nsystem\n(S'" + cmd.encode() + b"'\ntR.",
            b"\x80\x04" + _stack_global("os", "system") + _short_unicode(cmd) + b"\x85R.",
        ],
        (os.system.__module__, "system"): [pickle.dumps(_Reduce(os.system, cmd), protocol=p) for p in (0, 2, 4, 5)],
        ("builtins", "eval"): [pickle.dumps(_Reduce(builtins.eval, f"__import__('os').system({cmd!r})"), protocol=4)],
        ("builtins", "exec"): [pickle.dumps(_Reduce(builtins.exec, "import os"), protocol=4)],
        ("builtins", "getattr"): [b"cbuiltins\ngetattr\n(S'a'\nS'b'\ntR."],
        ("importlib", "import_module"): [pickle.dumps(_Reduce(importlib.import_module, "os"), protocol=4)],
        ("subprocess", "Popen"): [pickle.dumps(_Reduce(subprocess.Popen, ["touch", str(marker)]), protocol=4)],
        # hand-written: these modules do not exist on every platform
        ("posix", "system"): [b"cposix\nsystem\n(S'" + cmd.encode() + b"'\ntR."],
        ("nt", "system"): [b"cnt\nsystem\n(S'" + cmd.encode() + b"'\ntR."],
        ("__builtin__", "eval"): [b"c__builtin__\neval\n(S'1'\ntR."],
        ("copyreg", "_reconstructor"): [b"ccopyreg\n_reconstructor\n(cos\nsystem\nc__builtin__\nobject\nNtR."],
        ("torch", "load"): [b"\x80\x02ctorch\nload\nq\x00."],
        ("torch.serialization", "load"): [b"\x80\x02ctorch.serialization\nload\nq\x00."],
        ("pickle", "loads"): [b"\x80\x02cpickle\nloads\nq\x00."],
    }
    return out


def test_hostile_globals_are_refused_before_running(tmp_path):
    marker = tmp_path / "marker"
    for (module, name), pickles in _hostile(marker).items():
        for data in pickles:
            for loader in (load_metadata, lambda d, w: load_payload(d, w)):
                with pytest.raises(UnsafePickleError) as err:
                    loader(data, "hostile.pkl")
                # copyreg._reconstructor is named first; os.system inside never resolves
                assert (err.value.module, err.value.name) == (module, name)
                assert "hostile.pkl" in str(err.value) and f"{module}.{name}" in str(err.value)
    assert not marker.exists()


def test_hostile_global_inside_a_torch_save_archive(tmp_path):
    marker = tmp_path / "marker"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(_Reduce(os.system, _marker_command(marker)), protocol=2))
    with pytest.raises(UnsafePickleError, match=rf"{os.system.__module__}\.system"):
        torch_payload.load_value(out.getvalue(), "file.distcp (x)")
    assert not marker.exists()


def test_nearby_names_are_not_allowed():
    # exact pairs only: no prefix or attribute-path tricks
    for module, name in [
        ("torch", "float32.__class__"),
        ("torch.distributed.checkpoint.metadata", "os"),
        ("torch.distributed.checkpoint", "metadata"),
        ("collections", "OrderedDict.fromkeys"),
        ("numpy", "load"),
        ("numpy.core.multiarray", "_reconstruct.__globals__"),
        ("builtins", "set.__init__"),
    ]:
        data = b"\x80\x04" + _stack_global(module, name) + b"."
        with pytest.raises(UnsafePickleError) as err:
            load_metadata(data, "x")
        assert (err.value.module, err.value.name) == (module, name)


def _short_unicode(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _stack_global(module: str, name: str) -> bytes:
    return _short_unicode(module) + _short_unicode(name) + b"\x93"


def test_persistent_ids_refused_in_metadata():
    class P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", "x") if obj == "ref" else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump(["ref"])
    with pytest.raises(CorruptMetadataError, match="persistent id"):
        load_metadata(buf.getvalue(), "x")
    with pytest.raises(CorruptMetadataError, match="unsupported persistent id"):
        load_payload(buf.getvalue(), "x")


def _build_on(global_op: bytes, attr: str, value: str) -> bytes:
    """GLOBAL, then BUILD with state (None, {attr: value}): setattr without __setstate__."""
    def uni(s: str) -> bytes:
        return b"X" + len(s).to_bytes(4, "little") + s.encode()

    return b"\x80\x02" + global_op + b"N}" + uni(attr) + uni(value) + b"s\x86b."


def test_build_cannot_modify_shared_stand_ins():
    targets = [
        b"ctorch\nfloat32\n",  # the shared dtype stand-in
        b"ctorch\nFloatStorage\n",
        b"cpathlib\nPosixPath\n",  # an allow-listed function
        b"ctorch\nSize\n",  # stand-in classes
        b"ctorch.distributed.checkpoint.metadata\nMetadata\n",
        b"cnumpy\nndarray\n",
    ]
    for target in targets:
        for attr in ("name", "__defaults__", "FIELDS", "__setstate__"):
            with pytest.raises(CorruptMetadataError):
                load_metadata(_build_on(target, attr, "evil"), "x")
    assert safe_pickle.ALLOWED[("torch", "float32")].name == "float32"
    assert safe_pickle.Metadata.FIELDS[0] == "state_dict_metadata"


def test_codecs_and_bytes_cannot_amplify():
    with pytest.raises(CorruptMetadataError):
        load_metadata(b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00xX\x04\x00\x00\x00zlib\x86R.", "x")
    with pytest.raises(CorruptMetadataError):  # bytearray(10**12)
        load_metadata(b"\x80\x02c__builtin__\nbytearray\nJ\xff\xff\xff\x7f\x85R.", "x")


def test_object_numpy_arrays_are_refused():
    data = pickle.dumps(np.array([1, "a"], dtype=object), protocol=2)
    with pytest.raises(CkptError):
        load_payload(data, "x")


# -- malformed input -------------------------------------------------------------------
def test_truncated_metadata_is_corrupt(real_dcp):
    data = (real_dcp / ".metadata").read_bytes()
    for cut in range(0, len(data), 7):
        with pytest.raises(CorruptMetadataError):
            load_metadata(data[:cut], ".metadata")
    with pytest.raises(CorruptMetadataError, match="truncated pickle"):
        load_metadata(data[: len(data) // 2], ".metadata")


def test_oversized_pickle_is_refused(monkeypatch):
    monkeypatch.setattr(safe_pickle, "MAX_METADATA_BYTES", 10)
    with pytest.raises(CorruptMetadataError, match="exceeds"):
        load_metadata(pickle.dumps(list(range(100))), "x")


def test_errors_are_one_line():
    with pytest.raises(CorruptMetadataError) as err:
        load_metadata(b"\x80\x04garbage\n\n\n", "dir/.metadata")
    assert "\n" not in str(err.value) and str(err.value).startswith("dir/.metadata: ")


_REAL = {}


def _real_bytes() -> tuple[bytes, bytes]:
    """A real .metadata and a real tensor archive, made once with torch."""
    if not _REAL:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            dcp.save({"w": torch.randn(2, 3), "s": 1, "h": torch.ones(2, dtype=torch.float8_e5m2)}, checkpoint_id=tmp)
            _REAL["md"] = Path(tmp, ".metadata").read_bytes()
        buf = io.BytesIO()
        torch.save(torch.arange(6.0).reshape(2, 3).t(), buf)
        _REAL["archive"] = buf.getvalue()
    return _REAL["md"], _REAL["archive"]




_EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=8)
_FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=512))
def test_fuzz_random_bytes(data):
    for loader in (load_metadata, load_payload):
        try:
            loader(data, "fuzz")
        except CkptError:
            pass


@_FUZZ
@given(_EDITS)
def test_fuzz_mutated_metadata(edits):
    md, _ = _real_bytes()
    try:
        load_metadata(mutate_bytes(md, edits), "fuzz")
    except CkptError:
        pass


@_FUZZ
@given(_EDITS)
def test_fuzz_mutated_archive(edits):
    _, archive = _real_bytes()
    try:
        payload = torch_payload.open_payload(mutate_bytes(archive, edits), "fuzz")
        payload.value()
        if isinstance(payload.obj, TensorRef):
            payload.read_tensor(payload.tensor())
    except CkptError:
        pass


def _unicode(text: str) -> bytes:
    data = text.encode("utf-8")
    return b"X" + len(data).to_bytes(4, "little") + data


def test_state_dict_changed_after_build_stays_plain_data():
    """A record adopts its BUILD state dict; a pickle that edits that dict later
    (through the memo) can add keys, but cannot change the record's type."""
    data = (
        b"\x80\x02"
        + b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n"
        + b")\x81"  # NEWOBJ: the record
        + b"}q\x00("  # its state dict, memoized as 0
        + _unicode("offsets") + b"K\x00\x85"  # (0,)
        + _unicode("sizes") + b"K\x02\x85"  # (2,)
        + b"ub"  # SETITEMS, BUILD
        + b"q\x01"  # the record, memoized as 1
        + b"h\x00("  # the state dict again
        + _unicode("__class__") + _unicode("os.system")
        + _unicode("__getattr__") + _unicode("boom")
        + b"u0"  # SETITEMS, POP
        + b"h\x01."  # the record
    )
    obj = safe_pickle.load_metadata(data, "test")
    assert type(obj) is safe_pickle.ChunkStorageMetadata
    assert isinstance(obj, safe_pickle.ChunkStorageMetadata)
    assert (obj.offsets, obj.sizes) == ((0,), (2,))
    assert obj.__class__ is safe_pickle.ChunkStorageMetadata
    # the edit did reach the record's own dict, and changed nothing but data
    assert obj.__dict__["__getattr__"] == "boom"
    with pytest.raises(AttributeError):
        obj.not_a_field  # noqa: B018 - __getattr__ is still the class's


# -- the fast limits proof (pickle_scan) against the opcode walk -------------------------
from ckpt_tool.machinery.torch_save import pickle_scan  # noqa: E402

from conftest import FIXTURES  # noqa: E402

_CORPUS = Path(__file__).parents[2] / "fuzz_corpus"


def _archive_pickles(blob: bytes) -> list[bytes]:
    """Every `*data.pkl` member of the torch.save zip archives in `blob` (a .pt, or a .distcp's
    concatenation of archives): each end-of-central-directory record opens the archive before it."""
    out = []
    at = blob.find(b"PK\x05\x06")
    while at >= 0:
        try:
            with zipfile.ZipFile(io.BytesIO(blob[:at + 22])) as z:
                out += [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
        except Exception:  # noqa: BLE001 - a damaged archive of the fuzz corpus: its pickles are not reachable
            pass
        at = blob.find(b"PK\x05\x06", at + 4)
    return out


def _corpus_pickles() -> list[tuple[str, bytes]]:
    """The pickles of every fixture and of the fuzz corpus: .metadata files and torch.save data.pkl members."""
    out = []
    for root in (FIXTURES, _CORPUS):
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path.stat().st_size > 64 << 20:
                continue
            if path.name == ".metadata" or path.name.endswith(".metadata"):
                out.append((str(path), path.read_bytes()))
            elif path.suffix in (".pt", ".bin", ".distcp", ".pth"):
                out += [(f"{path} #{i}", p) for i, p in enumerate(_archive_pickles(path.read_bytes()))]
    return out


def _walk_verdict(data: bytes) -> str | None:
    try:
        safe_pickle.walk_limits(data, "x")
    except CkptError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _proved(data: bytes) -> bool:
    return pickle_scan.within_limits(data, safe_pickle.MAX_STACK_DEPTH, safe_pickle.MAX_OBJECTS)


def _canon(value, seen=None):
    """A comparable form of an unpickled value (stand-ins compare by type and fields)."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return ("<cycle>",)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (dict, list, tuple, set, frozenset)) or hasattr(value, "__dict__") or hasattr(value, "__slots__"):
        seen = seen | {id(value)}
    if isinstance(value, dict):
        return (type(value).__name__, [(_canon(k, seen), _canon(v, seen)) for k, v in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_canon(v, seen) for v in value])
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, sorted(repr(_canon(v, seen)) for v in value))
    fields = getattr(value, "__dict__", None)
    if fields is None and getattr(type(value), "__slots__", None):
        fields = {s: getattr(value, s, None) for s in type(value).__slots__}
    if fields is not None and not isinstance(value, (int, float, str, bytes)):
        return (type(value).__name__, _canon(dict(fields), seen))
    return (type(value).__name__, repr(value))


def _outcome(loader, data: bytes, fast: bool, monkeypatch):
    monkeypatch.setattr(safe_pickle, "FAST_SCAN_MIN_BYTES", 0 if fast else 1 << 62)
    try:
        value = loader(data, "x")
    except CkptError as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("value", _canon(value))


def test_fast_proof_is_taken_for_real_pickles():
    # the fast path must actually apply to what torch writes, else this whole section tests nothing
    md, archive = _real_bytes()
    assert _proved(md)
    for name in ("dcp_single", "dcp_fsdp2_adam", "megatron_torch_dist_tp2_dp2"):
        assert _proved((FIXTURES / name / ".metadata").read_bytes()), name
    assert not _proved(_archive_pickles(archive)[0])  # protocol 2 (BINPUT, BINUNICODE): walked


@pytest.mark.slow
def test_fast_proof_and_walk_agree_on_every_corpus_pickle(monkeypatch):
    corpus = _corpus_pickles()
    assert len(corpus) > 100
    proved = 0
    for name, data in corpus:
        if _proved(data):
            proved += 1
            assert _walk_verdict(data) is None, name
        for loader in (load_metadata, load_payload):
            assert _outcome(loader, data, True, monkeypatch) == _outcome(loader, data, False, monkeypatch), name
    assert proved >= 20


_LIMIT_CASES = [
    b"\x80\x04Nr" + (1 << 28).to_bytes(4, "little") + b".",  # LONG_BINPUT memo bomb
    b"Np268435456\n.",  # PUT
    b"\x80\x05\x96" + (1 << 62).to_bytes(8, "little") + b".",  # BYTEARRAY8 claiming 4 EiB
    b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b".",  # BINBYTES8
    b"\x80\x04\x8b" + (5000).to_bytes(4, "little") + b"\x01" * 5000 + b".",  # LONG4
    b"\x80\x04" + b"(" * 1000 + b".",  # MARKs nested
    b"\x80\x04" + b"(" * 300 + b"t" * 300 + b".",  # nested and closed
    b"\x80\x04" + b"\x95" + (1 << 40).to_bytes(8, "little") + b"N.",  # a frame past the end
    b"\x80\x04\x95" + (2).to_bytes(8, "little") + b"N.",  # a frame that ends exactly at the end
    b"\x80\x04" + b"N2" * (1 << 20) + b".",  # DUP: a 1M-deep stack
    b"\x80\x04" + b"(" + b"N" * ((1 << 20) + 8) + b"l.",  # one MARK level over the depth limit
    b"\x80\x04" + b"]" + b"(" + b"N" * 1000 + b"e" + b"." ,  # a small APPENDS
    # a short string whose length byte 0x95 looks like the next frame of the chain (its 8 bytes a length that
    # ends at the end): the copy reads a 241-byte string there, which the pattern refuses, and the walk decides
    b"\x80\x04\x95" + (1).to_bytes(8, "little") + b"\x8c\x95" + (142).to_bytes(8, "little") + b"a" * 141 + b".",
    b"\x80\x04\x8c\x95" + b"a" * 0x95 + b".",  # a 149-byte short string: walked (longer than the pattern admits)
    b"\x80\x04\xf1" + b"\x00" * 8 + b"N.",  # 0xF1 (the frame stand-in) in the data itself
    b"c" + b"a" * 9000 + b"\nb\n.",  # a long GLOBAL line
]


@pytest.mark.parametrize("data", _LIMIT_CASES)
def test_fast_proof_never_passes_what_the_walk_refuses(data, monkeypatch):
    if _proved(data):
        assert _walk_verdict(data) is None
    if _walk_verdict(data) is not None:
        assert not _proved(data)
    for loader in (load_metadata, load_payload):
        assert _outcome(loader, data, True, monkeypatch) == _outcome(loader, data, False, monkeypatch)


def test_fast_proof_of_a_deep_stack_inside_the_limit():
    # 100,000 values in one MARK level: provable (a level admits ~26,000 units of 4 one-byte opcodes)
    data = b"\x80\x04(" + b"N" * 100_000 + b"l."
    assert _proved(data) and _walk_verdict(data) is None


@_FUZZ
@given(_EDITS)
def test_fuzz_fast_proof_implies_walk_passes(edits):
    md, _ = _real_bytes()
    data = mutate_bytes(md, edits)
    if _proved(data):
        assert _walk_verdict(data) is None


@_FUZZ
@given(st.lists(st.sampled_from([b"(", b"N", b"t", b"l", b"e", b"u", b"0", b"2", b"\x94", b"K\x01", b"h\x00",
                                  b"\x8c\x01a", b"\x95" + (5).to_bytes(8, "little"), b"r\x00\x00\x00\x01", b"\x85",
                                  b"\x8c\x95", b"\xf1"]), max_size=60))
def test_fuzz_fast_proof_on_opcode_soup(parts):
    data = b"\x80\x04" + b"".join(parts) + b"."
    if _proved(data):
        assert _walk_verdict(data) is None


def test_hostile_globals_are_refused_the_same_with_the_fast_proof(tmp_path, monkeypatch):
    # the fast proof only skips the limits walk: a global outside the allow-list is still refused by name
    monkeypatch.setattr(safe_pickle, "FAST_SCAN_MIN_BYTES", 0)
    marker = tmp_path / "marker"
    proved = 0
    for (module, name), pickles in _hostile(marker).items():
        for data in pickles:
            proved += _proved(data)
            for loader in (load_metadata, lambda d, w: load_payload(d, w)):
                with pytest.raises(UnsafePickleError) as err:
                    loader(data, "hostile.pkl")
                assert (err.value.module, err.value.name) == (module, name)
    assert proved >= 5  # the protocol-4 ones are proved within the limits, and refused all the same
    assert not marker.exists()
