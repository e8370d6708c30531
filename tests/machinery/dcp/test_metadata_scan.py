"""metadata_scan: a DCP `.metadata` read in one pass without the unpickler, for torch's own pickles.

It must give exactly what the unpickler's path gives (the reader's fast parse of load_metadata's
object) wherever it gives anything, and nothing (None: the unpickler's path then runs) wherever
that path would fail or it is unsure: on every DCP fixture torch wrote, on a .metadata of many
tensors like the inspect benchmark's, and on damaged copies made by the fuzzer's mutators.
"""
from __future__ import annotations

import io
import pickle
import random

import pytest

import fuzz_lib as F
from ckpt_tool.base.errors import CkptError
from ckpt_tool.machinery.dcp import metadata_scan
from ckpt_tool.machinery.dcp import reader as dcp_reader
from ckpt_tool.machinery.torch_save import safe_pickle
from ckpt_tool.machinery.torch_save.pickle_budget import memory_budget

from conftest import fixture_path

ALL_DCP = sorted(p.parent.name for p in fixture_path("dcp_single").parent.glob("dcp_*/.metadata"))
_FIELDS = ("shape", "dtype", "chunks", "entries", "requires_grad", "duplicates", "layout", "copies")


def _unpickled(data: bytes):
    """The unpickler's path: its parse, or the error it raises (a CkptError's message)."""
    try:
        md = safe_pickle.load_metadata(data, "x")
    except CkptError as exc:
        return exc.message
    return dcp_reader.parse_well_formed(md)


def _same(scanned, unpickled) -> None:
    assert scanned is not None and unpickled is not None and not isinstance(unpickled, str)
    assert list(scanned.items) == list(unpickled.items)
    for fqn, item in unpickled.items.items():
        got = scanned.items[fqn]
        assert type(got) is type(item)
        if isinstance(item, dcp_reader._BytesItem):
            assert got.entry == item.entry
        else:
            assert {f: getattr(got, f) for f in _FIELDS} == {f: getattr(item, f) for f in _FIELDS}, fqn
    assert list(scanned.storage.items()) == list(unpickled.storage.items())
    assert scanned.keys == unpickled.keys
    assert scanned.needed == unpickled.needed and scanned.transforms == unpickled.transforms
    assert scanned.version == unpickled.version and scanned.planner_data == unpickled.planner_data


def _check(data: bytes) -> bool:
    """Both paths on `data`: equal where the scan gives a parse (True), else the scan gave none."""
    md = metadata_scan.scan(data)
    scanned = None if md is None else dcp_reader.parse_well_formed(md)
    if scanned is None:
        return False
    _same(scanned, _unpickled(data))
    return True


def _counts(md) -> tuple[int, int]:
    tensors = sum(type(v) is metadata_scan._ScannedTensor for v in md.state_dict_metadata.values())
    stored = sum(type(k) is metadata_scan._ScannedIndex for k in md.storage_data)
    return tensors, stored


@pytest.mark.parametrize("name", ALL_DCP)
def test_every_fixture_reads_as_the_unpickler_reads_it(name):
    data = (fixture_path(name) / ".metadata").read_bytes()
    md = metadata_scan.scan(data)
    assert md is not None, "torch's own .metadata must be read by the scan"
    assert dcp_reader._parse_fast(md) is not None or dcp_reader._parse_fast(safe_pickle.load_metadata(data, "x")) is None
    if dcp_reader._parse_fast(md) is not None:
        _same(dcp_reader._parse_fast(md), _unpickled(data))


def _many_tensors(n: int) -> bytes:
    """A .metadata of n small one-chunk tensors as torch writes it (the inspect benchmark's shape),
    pickled by torch itself."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    sdm, storage, planner = {}, {}, {}
    offset = 0
    for i in range(n):
        for name, shape, dtype in (("w", (64, 64), torch.float32), ("b", (64,), torch.float32),
                                   ("s", (), torch.bfloat16), ("t", (2, 3, 4, 5), torch.int64)):
            fqn = f"layers.{i}.{name}"
            size = torch.Size(shape)
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), size,
                [ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))])
            length = 1000 + i
            storage[MetadataIndex(fqn, torch.Size([0] * len(shape)), 0)] = _StorageInfo("__0_0.distcp", offset, length)
            offset += length
            planner[fqn] = ("layers", str(i), name)
    offset_big = MetadataIndex("big", torch.Size([0]), 0)
    sdm["big"] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([10]),
                                       [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([10]))])
    storage[offset_big] = _StorageInfo("__1_0.distcp", 5 << 32, 40)  # an offset past 4 GiB: LONG1
    planner["big"] = ("big",)
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    out = io.BytesIO()
    pickle.dump(md, out)  # as torch's FileSystemWriter writes it
    return out.getvalue()


def test_many_tensors_take_the_matched_records():
    data = _many_tensors(600)
    md = metadata_scan.scan(data)
    assert md is not None
    tensors, stored = _counts(md)
    # all but the first few (the records that define the classes and strings, and those a frame splits)
    assert tensors > 2300 and stored > 2300
    _same(dcp_reader._parse_fast(md), _unpickled(data))


def test_damaged_copies_read_as_the_unpickler_reads_them_or_not_at_all():
    sources = [(fixture_path(name) / ".metadata").read_bytes() for name in ("dcp_single", "dcp_multirank")]
    sources.append(_many_tensors(40))
    rng = random.Random(46)
    scanned = 0
    for i in range(1000):
        data = sources[i % len(sources)]
        mutant, _what = (F.mutate_dcp_metadata if i % 2 else F.bytes_mutation)(rng, data)
        if mutant is None:
            continue
        scanned += _check(mutant)
    assert scanned > 50  # (many mutants of a pickle still read: the two paths agree on them)


def test_storage_keys_stay_apart_as_torch_keeps_them():
    # MetadataIndex hashes by identity here: two equal keys are two entries, scanned or not
    a = metadata_scan._ScannedIndex(("w", (0,), 0))
    b = metadata_scan._ScannedIndex(("w", (0,), 0))
    assert len({a: 1, b: 2}) == 2 and a != b and a == a


def test_a_global_outside_the_allow_list_is_left_to_the_unpickler():
    data = pickle.dumps({"x": print}, protocol=4)
    assert metadata_scan.scan(data) is None
    with pytest.raises(CkptError):
        safe_pickle.load_metadata(data, "x")


def test_past_the_memory_limit_it_reads_nothing():
    data = _many_tensors(50)
    assert metadata_scan.scan(data) is not None
    with memory_budget(0):  # (the limit left is the fixed allowance)
        limit = safe_pickle.memory_limit()
    big = _many_tensors(50)
    assert 64 * len(big) < limit  # what the scan charges a matched record, per byte
    from ckpt_tool.machinery.torch_save import pickle_budget

    original = pickle_budget.PICKLE_ALLOWANCE
    try:
        pickle_budget.PICKLE_ALLOWANCE = 0
        with memory_budget(4 * len(big)):  # room for the data, not for what the records build
            assert metadata_scan.scan(big) is None
    finally:
        pickle_budget.PICKLE_ALLOWANCE = original


def test_a_reference_to_a_record_it_did_not_keep_is_left_to_the_unpickler():
    # the same TensorProperties object under two tensors: the second refers back into the first record
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
    )

    shared = TensorProperties(dtype=torch.float32)
    sdm = {f"t{i}": TensorStorageMetadata(shared, torch.Size([2]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
           for i in range(4)}
    data = pickle.dumps(Metadata(state_dict_metadata=sdm), protocol=4)
    md = metadata_scan.scan(data)
    if md is not None:  # (read by the interpreter, record by record: then as the unpickler reads it)
        assert {k: type(v) for k, v in md.state_dict_metadata.items()} == {
            k: type(v) for k, v in safe_pickle.load_metadata(data, "x").state_dict_metadata.items()}


def test_inspect_takes_the_scan(tmp_path):
    # a torch .metadata opened by the reader: the scan's result is the parse (the unpickler never runs)
    from ckpt_tool.storage import Storage

    calls = []
    original = safe_pickle.load_metadata
    try:
        safe_pickle.load_metadata = lambda *a, **k: calls.append(1) or original(*a, **k)
        dcp_reader._LAST_PARSED = None
        ck = dcp_reader.read(Storage.open(str(fixture_path("dcp_single"))), fmt="dcp")
    finally:
        safe_pickle.load_metadata = original
    assert ck.leaves and not calls


def _new(text: str) -> str:
    """`text` as a new str object: each rank's save plan holds its own strings, so a multi-rank
    .metadata writes a storage entry's fqn and a planner path's strings anew, not as references."""
    return "".join(list(text))


def _sharded(layers: int, ranks: int = 4, wide: int = 0) -> bytes:
    """A .metadata as a sharded save of `ranks` ranks writes it (FSDP / TP: a tensor's chunks one a
    rank's shard), pickled by torch: per layer a bf16 weight split unevenly over dim 0, a replicated
    f32 bias (one chunk, rank 0's), Adam's state (exp_avg over dim 0, exp_avg_sq over dim 1, a step
    scalar) keyed by param id (an int in its planner path); a tensor listing one chunk twice; and,
    given `wide`, a tensor of `wide` chunks (past pickle's batch of 1000 appends: two batches)."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    def split(shape, dim):
        """[(offsets, sizes, rank)] as DTensor's Shard(dim) splits (ceil-sized, the last short or none)."""
        if dim is None:
            return [([0] * len(shape), list(shape), 0)]
        step = -(-shape[dim] // ranks)
        out = []
        for rank in range(ranks):
            start = rank * step
            if start >= shape[dim]:
                break
            off, size = [0] * len(shape), list(shape)
            off[dim], size[dim] = start, min(step, shape[dim] - start)
            out.append((off, size, rank))
        return out

    sdm, planner = {}, {}
    written: list[list[tuple]] = [[] for _ in range(ranks)]
    recipe = (("model.layers.{}.w", ("model", "layers.{}.w"), (10, 8), torch.bfloat16, 0),
              ("model.layers.{}.b", ("model", "layers.{}.b"), (8,), torch.float32, None),
              ("optim.state.{}.exp_avg", ("optim", "state", "#", "exp_avg"), (10, 8), torch.float32, 0),
              ("optim.state.{}.exp_avg_sq", ("optim", "state", "#", "exp_avg_sq"), (10, 8), torch.float32, 1),
              ("optim.state.{}.step", ("optim", "state", "#", "step"), (), torch.float32, None))
    for i in range(layers):
        for name, path, shape, dtype, dim in recipe:
            fqn = name.format(i)
            chunks = split(shape, dim)
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(shape),
                [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in chunks])
            for o, s, rank in chunks:
                written[rank].append((fqn, o, s))
            planner[_new(fqn)] = tuple(i if p == "#" else _new(p.format(i)) for p in path)
    extra = [("twice", (6,), [((0,), (3,), 0), ((3,), (3,), 1), ((0,), (3,), 2)])]
    if wide:
        extra.append(("wide", (wide,), [((k,), (1,), k % ranks) for k in range(wide)]))
    for fqn, shape, chunks in extra:
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size(shape),
            [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in chunks])
        for o, s, rank in chunks:
            written[rank].append((fqn, list(o), list(s)))
        planner[_new(fqn)] = (_new(fqn),)
    sdm["optim.param_groups.0.lr"] = BytesStorageMetadata()
    written[0].append(("optim.param_groups.0.lr", None, None))
    planner[_new("optim.param_groups.0.lr")] = ("optim", "param_groups", 0, "lr")
    storage = {}
    for rank, items in enumerate(written):  # (each rank's write results in turn, as the coordinator merges them)
        at = 0
        path = _new(f"__{rank}_0.distcp")  # (one string a rank's data file, as its writer returns them)
        for index, (fqn, o, s) in enumerate(items):
            length = 4 * (1 if s is None else max(1, int(torch.Size(s).numel())))
            offset = None if o is None else torch.Size(o)
            storage[MetadataIndex(_new(fqn), offset, index)] = _StorageInfo(path, at, length)
            at += length
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    out = io.BytesIO()
    pickle.dump(md, out)  # as torch's FileSystemWriter writes it
    return out.getvalue()


def test_a_sharded_save_takes_the_matched_records():
    # several chunks a tensor: matched whole (one look-up for tensors sharded alike), as the unpickler reads them
    data = _sharded(200)
    md = metadata_scan.scan(data)
    assert md is not None
    kinds = [type(v) for v in md.state_dict_metadata.values()]
    assert kinds.count(metadata_scan._ScannedShards) > 590 and kinds.count(metadata_scan._ScannedTensor) > 390
    assert _counts(md)[1] > 2000  # the storage entries, their fqn a new string each
    _same(dcp_reader._parse_fast(md), _unpickled(data))
    twice = dcp_reader._parse_fast(md).items["twice"]
    assert twice.duplicates == 1 and len(twice.chunks) == 2


def test_a_tensor_of_more_chunks_than_one_batch_reads_as_the_unpickler_reads_it():
    data = _sharded(3, wide=1003)
    assert _check(data)


def test_a_real_fsdp2_save_takes_the_matched_records():
    # torch's own save (fixtures/gen_fsdp2.py: two ranks, FSDP2, Adam): its sharded tensors past the
    # first of a kind are matched
    data = (fixture_path("dcp_fsdp2_adam") / ".metadata").read_bytes()
    md = metadata_scan.scan(data)
    assert sum(type(v) is metadata_scan._ScannedShards for v in md.state_dict_metadata.values()) >= 8
    _same(dcp_reader._parse_fast(md), _unpickled(data))


def test_damaged_sharded_copies_read_as_the_unpickler_reads_them_or_not_at_all():
    source = _sharded(12)
    rng = random.Random(4646)
    scanned = 0
    for i in range(600):
        mutant, _what = (F.mutate_dcp_metadata if i % 2 else F.bytes_mutation)(rng, source)
        if mutant is None:
            continue
        scanned += _check(mutant)
    assert scanned > 30


def test_a_layout_it_does_not_match_is_handed_over_early(monkeypatch):
    # every tensor entry refers back to one shared TensorProperties (no pattern matches them): the
    # interpreter builds a few records, not all of them, before it leaves the pickle to the unpickler
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata,
    )

    shared = TensorProperties(dtype=torch.float32)
    sdm = {f"t{i}": TensorStorageMetadata(shared, torch.Size([2]), [ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))])
           for i in range(2000)}
    data = pickle.dumps(Metadata(state_dict_metadata=sdm), protocol=4)
    built = []
    original = safe_pickle.TensorStorageMetadata.__setstate__
    monkeypatch.setattr(safe_pickle.TensorStorageMetadata, "__setstate__",
                        lambda self, state: built.append(1) or original(self, state))
    assert metadata_scan.scan(data) is None
    assert len(built) <= metadata_scan._GIVE_UP_AFTER + 1
    assert safe_pickle.load_metadata(data, "x") is not None


def test_tensors_alike_are_compared_with_one_matched_before(monkeypatch):
    """A tensor entry whose bytes after its key are a known entry's is read by comparing them (no
    pattern run): 2,400 tensors of 4 kinds run the tensor pattern a few times, not once each
    (issue 46), and read as the unpickler reads them."""
    data = _many_tensors(600)
    runs = []

    class Counting:
        def __init__(self, pattern):
            self.pattern = pattern

        def match(self, *args):
            runs.append(args[1])
            return self.pattern.match(*args)

    monkeypatch.setattr(metadata_scan, "_TENSOR", Counting(metadata_scan._TENSOR))
    md = metadata_scan.scan(data)
    assert md is not None and _counts(md)[0] > 2300
    assert len(runs) < 100  # (the first of each kind, those a frame splits, the planner paths' first keys)
    _same(dcp_reader._parse_fast(md), _unpickled(data))


def test_a_planner_path_naming_its_own_new_key_again_reads_as_the_unpickler_reads_it():
    """A path whose key repeats a string made in the same path (the pickler writes the second as
    a reference to the first): such a reference is not taken as one that means the same in every
    path (the memo entry it names is this path's), as a reference to an earlier record is."""
    torch = pytest.importorskip("torch")
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
    )

    sdm, storage, planner = {}, {}, {}
    for i in range(40):
        part = f"p{i % 3}"  # one object for both keys of the path
        fqn = f"{part}.{part}.{i}"
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([2]),
                                         [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([2]))])
        storage[MetadataIndex(fqn, torch.Size([0]), 0)] = _StorageInfo("__0_0.distcp", 8 * i, 8)
        planner[fqn] = (part, part, str(i))
    out = io.BytesIO()
    pickle.dump(Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage), out)
    assert _check(out.getvalue())


def test_the_fast_parse_checks_a_scanned_tensor_value_once(monkeypatch):
    """The scan gives tensors alike one value: the fast parse checks it (dtype, memory format, the
    one chunk the whole tensor) once, each tensor then looking up its own storage entry (issue 46);
    2,400 tensors of 4 kinds were 2,400 checks. A tensor of them without its storage entry is
    still refused there (the careful walk then names it)."""
    data = _many_tensors(600)
    md = metadata_scan.scan(data)
    checks = []
    real = dcp_reader._whole_chunk
    monkeypatch.setattr(dcp_reader, "_whole_chunk", lambda *args: checks.append(args[0]) or real(*args))
    parsed = dcp_reader._parse_fast(md)
    assert len(checks) < 20
    _same(parsed, _unpickled(data))
    missing = next(k for k in md.storage_data if type(k) is metadata_scan._ScannedIndex and k[0] == "layers.300.b")
    del md.storage_data[missing]
    assert dcp_reader._parse_fast(md) is None
