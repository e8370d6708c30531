"""validate agrees with torch.load(path, weights_only=True) on what a torch.save pickle may say (issue 29).

Every input is written by torch.save itself: a value whose `__reduce_ex__` returns torch's own
rebuild call (`_rebuild_tensor_v2`, `_rebuild_parameter(_with_state)`, `_rebuild_from_type_v2`) with
the arguments under test, so torch's pickler writes the storages, the archive and the globals exactly
as it does for a real tensor; a storage location is changed by rewriting the one `'cpu'` string of
data.pkl (tests/fuzz_lib.with_torch_pickle keeps the archive's CRC and offsets right). Each test asks
torch.load first (the oracle) and then ckpt: a file torch refuses must be a finding naming the file
and the tensor (exit 1), a file torch loads must still validate (exit 0).
"""
from __future__ import annotations

import collections
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

from fuzz_lib import torch_pickle_bytes, with_torch_pickle  # noqa: E402

_R = torch._utils
_FROM_TYPE = torch._tensor._rebuild_from_type_v2
_HOOKS = collections.OrderedDict


class _Call:
    """Pickled as `fn(*args)`: torch.save writes the global and the arguments (storages by persistent id)."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce_ex__(self, protocol: int) -> tuple:
        return self.fn, self.args


def _floats() -> Any:
    return torch.arange(4, dtype=torch.float32)


def _ints() -> Any:
    return torch.arange(4, dtype=torch.int64)


def _v2_args(t: Any, offset: int = 0, size: tuple = (4,), stride: tuple = (1,), requires_grad: Any = False) -> tuple:
    return (t._typed_storage(), offset, size, stride, requires_grad, _HOOKS())


def _v2(t: Any, *args: Any, **kwargs: Any) -> _Call:
    return _Call(_R._rebuild_tensor_v2, _v2_args(t, *args, **kwargs))


def _param(t: Any, requires_grad: Any, state: Any = None, with_state: bool = False) -> _Call:
    if with_state:
        return _Call(_R._rebuild_parameter_with_state, (_v2(t), requires_grad, _HOOKS(), state))
    return _Call(_R._rebuild_parameter, (_v2(t), requires_grad, _HOOKS()))


def _with_state(t: Any, state: Any) -> _Call:
    """A plain tensor carrying Python attributes: torch writes `_rebuild_from_type_v2(v2, Tensor, args, state)`."""
    return _Call(_FROM_TYPE, (_R._rebuild_tensor_v2, torch.Tensor, _v2_args(t), state))


def _empty() -> Any:
    return torch.zeros(0)


# torch.load(weights_only=True) refuses each of these; (the value saved as {"w": value}, a phrase of ckpt's line)
REFUSED: dict[str, tuple[Callable[[], Any], str]] = {
    "requires_grad an int": (lambda: _v2(_floats(), requires_grad=1), "requires_grad is 1, not a bool"),
    "requires_grad None": (lambda: _v2(_floats(), requires_grad=None), "requires_grad is None, not a bool"),
    "requires_grad on int64": (lambda: _v2(_ints(), requires_grad=True), "requires_grad=True on an int64 tensor"),
    "Parameter requires_grad an int": (lambda: _param(_floats(), 1), "requires_grad is 1, not a bool"),
    "Parameter requires_grad on int64": (lambda: _param(_ints(), True), "requires_grad=True on an int64 tensor"),
    "Parameter state with an int key": (lambda: _param(_floats(), False, {1: "x"}, True),
                                        "attribute name 1 is not a string"),
    "Parameter state sets requires_grad on int64": (lambda: _param(_ints(), False, {"requires_grad": True}, True),
                                                    "requires_grad=True on an int64 tensor"),
    "Parameter state a 3-tuple": (lambda: _param(_floats(), False, (None, None, None), True),
                                  "state is a tuple of 3, not (dict, slots)"),
    "state a 3-tuple": (lambda: _with_state(_floats(), (None, None, None)), "state is a tuple of 3, not (dict, slots)"),
    "state a list": (lambda: _with_state(_floats(), [1]), "state is a list, not a dict"),
    "state slots not a dict": (lambda: _with_state(_floats(), ({}, [1])), "slots state is a list, not a dict"),
    "state sets requires_grad on int64": (lambda: _with_state(_ints(), {"requires_grad": True}),
                                          "requires_grad=True on an int64 tensor"),
    "state slots set requires_grad to an int": (lambda: _with_state(_floats(), (None, {"requires_grad": 1})),
                                                "requires_grad is 1, not a bool"),
    "state sets a read-only attribute": (lambda: _with_state(_floats(), {"shape": (2, 2)}),
                                         "sets torch.Tensor's own attribute 'shape'"),
    "state sets data": (lambda: _with_state(_floats(), {"data": 1}), "sets torch.Tensor's own attribute 'data'"),
    "storage offset 2**63 on an empty tensor": (lambda: _v2(_empty(), 2**63, (0,), (1,)), "2**63"),
    "size 2**63 on an empty tensor": (lambda: _v2(_empty(), 0, (0, 2**63), (1, 1)), "2**63"),
    "stride 2**63 on a one-element tensor": (lambda: _v2(_floats(), 0, (1,), (2**63,)), "2**63"),
    "stride 2**64 on an empty tensor": (lambda: _v2(_empty(), 0, (0,), (2**64,)), "2**63"),
    "sizes whose product overflows before a 0": (lambda: _v2(_empty(), 0, (2**62, 2**62, 0), (1, 1, 1)),
                                                 "overflows 64 bits"),
}

# torch.load(weights_only=True) loads each of these
LOADED: dict[str, Callable[[], Any]] = {
    "requires_grad on float32": lambda: _v2(_floats(), requires_grad=True),
    "Parameter requires_grad on float32": lambda: _param(_floats(), True),
    "Parameter with Megatron-style attributes": lambda: _param(
        _floats(), True, {"tensor_model_parallel": True, "partition_dim": 0, "grad": None}, True),
    "Parameter state (None, None)": lambda: _param(_floats(), False, (None, None), True),
    "state empty": lambda: _with_state(_floats(), {}),
    "state None": lambda: _with_state(_floats(), None),
    "state falsy non-dict": lambda: _with_state(_floats(), 0),
    "state (dict, slots)": lambda: _with_state(_floats(), ({"note": "x"}, {"requires_grad": True})),
    "state sets an attribute": lambda: _with_state(_floats(), {"note": 1}),
    "storage offset 2**63-1 on an empty tensor": lambda: _v2(_empty(), 2**63 - 1, (0,), (1,)),
    "size 2**63-1 on an empty tensor": lambda: _v2(_empty(), 0, (0, 2**63 - 1), (1, 1)),
    "stride 2**63-1 on a one-element tensor": lambda: _v2(_floats(), 0, (1,), (2**63 - 1,)),
    "sizes 2**62 x 2 x 0": lambda: _v2(_empty(), 0, (2**62, 2, 0), (1, 1, 1)),
}


def _save(path: Path, value: Any) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save({"w": value}, path)
    return path


def _torch_load_error(path: Path) -> str | None:
    """torch.load(path, weights_only=True)'s error (None: it loads)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the oracle's verdict, whatever it raises
        return f"{type(exc).__name__}: {exc}"
    return None


def _finding(r: Any, phrase: str) -> dict:
    """The finding of `ckpt validate --json` whose message holds `phrase`."""
    found = [f for f in json.loads(r.stdout)["findings"] if phrase in f["message"]]
    assert found, f"no finding with {phrase!r} in:\n{r.stdout}{r.stderr}"
    return found[0]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_validate_refuses_what_torch_load_refuses(case: str, tmp_path: Path, ckpt) -> None:
    build, phrase = REFUSED[case]
    path = _save(tmp_path / "model.pt", build())
    assert _torch_load_error(path) is not None, "torch.load loads it: not a refused input"
    r = ckpt("validate", "--json", path)
    assert r.returncode == 1, r.stdout + r.stderr
    finding = _finding(r, phrase)
    assert (finding["severity"], finding["file"], finding["leaf"]) == ("error", "model.pt", "w"), finding
    assert "Traceback" not in r.stdout + r.stderr and "internal error" not in r.stdout + r.stderr


@pytest.mark.parametrize("case", sorted(LOADED))
def test_validate_accepts_what_torch_load_loads(case: str, tmp_path: Path, ckpt) -> None:
    path = _save(tmp_path / "model.pt", LOADED[case]())
    assert _torch_load_error(path) is None
    r = ckpt("validate", path)
    assert r.returncode == 0, r.stdout + r.stderr


def _at_location(path: Path, location: str) -> Path:
    """The file with its storage's location 'cpu' rewritten (the archive's CRC and offsets kept right)."""
    data = path.read_bytes()
    pkl = torch_pickle_bytes(data)
    old = b"X\x03\x00\x00\x00cpu"  # BINUNICODE 'cpu'
    assert pkl is not None and pkl.count(old) == 1
    new = b"X" + len(location.encode()).to_bytes(4, "little") + location.encode()
    path.write_bytes(with_torch_pickle(data, pkl.replace(old, new)))
    return path


# locations no deserializer torch registers restores: torch.load fails on every machine
@pytest.mark.parametrize("location", ["bogus_device", "cpu:0", "CUDA:0", "cuda:abc", "cuda0", "cuda:01", "meta:0", ""])
def test_a_location_torch_cannot_restore_is_a_finding(location: str, tmp_path: Path, ckpt) -> None:
    path = _at_location(_save(tmp_path / "model.pt", torch.zeros(4)), location)
    error = _torch_load_error(path)
    assert error is not None and ("don't know how to restore" in error or "Invalid device string" in error), error
    r = ckpt("validate", "--json", path)
    assert r.returncode == 1, r.stdout + r.stderr
    finding = _finding(r, "torch.load cannot restore")
    assert (finding["severity"], finding["file"], finding["leaf"]) == ("error", "model.pt", "w"), finding
    assert repr(location) in finding["message"], finding


@pytest.mark.skipif(torch.cuda.is_available(), reason="the oracle's failure needs a machine without CUDA")
def test_a_cuda_location_is_a_warning_naming_map_location(tmp_path: Path, ckpt) -> None:
    path = _at_location(_save(tmp_path / "model.pt", torch.zeros(4)), "cuda:0")
    assert "torch.cuda.is_available() is False" in (_torch_load_error(path) or "")
    # what a user without a GPU does, and what a machine with one does by itself
    assert torch.load(path, weights_only=True, map_location="cpu")["w"].shape == (4,)
    r = ckpt("validate", "--json", path)
    assert r.returncode == 0, r.stdout + r.stderr
    finding = _finding(r, "map_location='cpu'")
    assert (finding["severity"], finding["code"], finding["file"]) == ("warning", "device-location", "model.pt")
    assert "'cuda:0'" in finding["message"] and "CUDA" in finding["message"], finding


def test_a_meta_location_loads_without_values_and_says_so(tmp_path: Path, ckpt) -> None:
    path = _at_location(_save(tmp_path / "model.pt", torch.ones(4)), "meta")
    assert torch.load(path, weights_only=True)["w"].is_meta
    r = ckpt("validate", "--json", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _finding(r, "map_location='cpu'")["severity"] == "warning"
    assert "meta tensors" in _finding(r, "map_location='cpu'")["message"]


def test_convert_refuses_a_file_validate_calls_bad(tmp_path: Path, ckpt) -> None:
    path = _save(tmp_path / "model.pt", _v2(_ints(), requires_grad=True))
    assert _torch_load_error(path) is not None
    r = ckpt("convert", "--to", "safetensors", path, tmp_path / "out")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "requires_grad=True on an int64 tensor" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
    r = ckpt("inspect", path)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


# --memory bounds the unpickler in every command, as in validate (pickle_budget.memory_budget)
@pytest.mark.slow
def test_convert_refuses_a_pickle_over_its_memory_as_validate_does(tmp_path: Path, ckpt) -> None:
    from test_pickle_memory import _builders, _torch_save_with_pickle

    from ckpt_tool.machinery.torch_save import pickle_budget

    # 30 set() copies of a memoized 100,000-int list: ~550 MB charged as the stand-ins build them, over
    # 4 MiB + the 512 MiB allowance, under the default 512 + 512 MiB (what convert used before)
    path = tmp_path / "sets.pt"
    _torch_save_with_pickle(path, _builders()["set_copies"](30))
    assert pickle_budget.memory_limit() == 1024 << 20
    refused = "unpickling it would take more than the 516 MiB of memory allowed"
    r = ckpt("validate", "--memory", "4M", path)
    assert r.returncode == 1 and refused in r.stdout + r.stderr, r.stdout + r.stderr
    r = ckpt("convert", "--to", "safetensors", "--memory", "4M", path, tmp_path / "out")
    assert r.returncode == 1 and refused in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "out").exists()
    r = ckpt("diff", "--memory", "4M", path, path)
    assert r.returncode == 1 and refused in r.stdout + r.stderr, r.stdout + r.stderr


def test_worker_threads_unpickle_within_the_commands_budget() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ckpt_tool.machinery.torch_save import pickle_budget

    with pickle_budget.memory_budget(1 << 20), ThreadPoolExecutor(1) as pool:
        # a pool's thread starts with an empty context: it reads the process's budget
        assert pool.submit(pickle_budget.memory_limit).result() == (1 << 20) + pickle_budget.PICKLE_ALLOWANCE
    assert pickle_budget.memory_limit() == pickle_budget.DEFAULT_BUDGET + pickle_budget.PICKLE_ALLOWANCE
