"""A complete Hugging Face export: the model's other files beside the weights, and `--like`.

`from_pretrained` needs more than the tensors: `config.json`, `generation_config.json`, the
tokenizer's files. Converting a Hugging Face directory to safetensors carries them over
(companion_files); from any other source (a Megatron or DCP checkpoint), `--like HF_DIR` names a
reference model directory: its companion files are copied, and the output must hold exactly
the reference's tensor names, shapes and dtypes, after --rename and --unstack; with --dtype each
dtype is checked against the reference's tensor cast by the --dtype rule (the cast is intended). Every
difference is listed and nothing is written when there is one (`--force-like` writes anyway).

Tied weights: transformers saves a model whose `config.json` says `tie_word_embeddings` (the
default for most architectures) without its output embedding (`lm_head.weight`), and ties it to
the input embedding on load. A source that stores both (a torch `.bin` or a Megatron checkpoint
with `untie_embeddings_and_output_weights=False`) has one tensor more than the reference: it is
left out, and reported as left out, when the reference ties them, does not hold it and holds an
input embedding of its shape; nothing else is ever dropped.

The engine imports this module only where a model's files may go beside the output (--like, or a
target that takes them: safetensors); a convert to DCP or Orbax, and a reshard, load none of it.
"""
from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import formats
from ..base import dtypes
from ..base.errors import CkptError, UsageError
from ..core.write_plan import TargetArray
from ..formats import HF_MODEL_FILES
from ..storage import Storage

if TYPE_CHECKING:
    from ..core.model import Checkpoint
    from ..core.write_plan import WritePlan
    from .planner import ConvertOptions

# top-level files of a Hugging Face model directory that are not weights (transformers' and
# tokenizers' names): the registry's list, which --overwrite also counts as the model's own;
# training state beside them (optimizer.pt, trainer_state.json) is not the model's
COMPANIONS = HF_MODEL_FILES
MAX_COMPANION_BYTES = 1 << 30
# companion files that name the dtype the model loads in, and the fields that do (transformers 5
# writes `dtype`; before 4.56 it wrote `torch_dtype`, which it still reads); generation_config.json
# and the tokenizer's files name none
CONFIGS_WITH_DTYPE = ("config.json",)
DTYPE_FIELDS = ("dtype", "torch_dtype")
# a config rewritten for --dtype is parsed whole: real ones are a few KiB
MAX_CONFIG_BYTES = 16 << 20
# transformers' output embedding, tied to the input embedding when tie_word_embeddings holds
TIED_OUTPUT_NAMES = ("lm_head.weight",)


def companion_files(storage: Storage) -> list[str]:
    """The non-weight model files at the top of a Hugging Face directory."""
    _, files = storage.listdir()
    return sorted(f for f in files if any(fnmatch.fnmatchcase(f, p) for p in COMPANIONS))


def is_model_directory(storage: Storage) -> bool:
    """A Hugging Face model directory: a config.json beside the weights."""
    return "config.json" in storage.listdir()[1]


def copy_companions(src: Storage, names: list[str], dst: Storage, replaced: dict[str, bytes] | None = None) -> None:
    """Copy the companion files into the (temporary) output, each whole (they are small);
    `replaced`: the new contents of some of them (retyped_configs)."""
    for name in names:
        if replaced and name in replaced:
            dst.write(name, replaced[name])
            continue
        size = src.size(name)
        if size > MAX_COMPANION_BYTES:
            raise CkptError(f"{size} bytes: too large for a model's companion file", f"{src.url}/{name}")
        dst.write(name, src.read(name))


def retyped_configs(src: Storage, names: list[str], dtype: str) -> tuple[dict[str, bytes], list[tuple[str, str, str]]]:
    """The companion configs whose dtype fields must name `dtype` (ckpt's name) after `--dtype`.

    transformers' `from_pretrained` loads a model in the dtype its config.json names (`dtype`;
    `torch_dtype` before transformers 4.56, still read), sub-configs included: a cast export that
    kept `"dtype": "float32"` would load as float32. Each such field naming a floating torch dtype
    is set to the new one; anything else (a token id under a `dtype` key, "auto") stays.
    Returns (file -> new bytes, [(file, field path, the old value)]); a file that needs no change
    is not in it (copied byte for byte)."""
    torch_name = dtypes.get(dtype).torch
    out: dict[str, bytes] = {}
    changes: list[tuple[str, str, str]] = []
    if torch_name is None:  # no torch dtype: transformers cannot load it whatever the config says
        return out, changes
    for name in names:
        if name not in CONFIGS_WITH_DTYPE:
            continue
        where = f"{src.url}/{name}"
        size = src.size(name)
        if size > MAX_CONFIG_BYTES:
            raise CkptError(f"{size} bytes: too large for a model config (at most {MAX_CONFIG_BYTES >> 20} MiB), "
                            f"so --dtype cannot set its dtype", where)
        try:
            config = json.loads(src.read(name))
            fields = _set_dtype_fields(config, torch_name)
            text = json.dumps(config, indent=2) + "\n" if fields else ""
        except RecursionError:
            raise CkptError("nested too deeply to be a model config, so --dtype cannot set its dtype", where) from None
        except ValueError:  # (UnicodeDecodeError included)
            raise CkptError("not valid JSON, so --dtype cannot set its dtype (from_pretrained would not read it "
                            "either)", where) from None
        if fields:
            out[name] = text.encode()
            changes.extend((name, field_path, old) for field_path, old in fields)
    return out, changes


def _set_dtype_fields(config: Any, torch_name: str) -> list[tuple[str, str]]:
    """Set every dtype field naming a floating torch dtype, in `config` and its nested objects
    (sub-configs), to `torch_name`; [(dotted field path, old value)] of those changed. A walk with
    its own stack: a config nested as deep as the JSON parser allows is no recursion limit here."""
    changed: list[tuple[str, str]] = []
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:
        prefix, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key in DTYPE_FIELDS and isinstance(node, dict):
                if _floating_torch_name(value) and value != torch_name:
                    node[key] = torch_name
                    changed.append((path, value))
                    continue
                if isinstance(value, dict):  # a dtype per sub-config: {"": "float32", "text_config": ...}
                    for sub, sub_value in value.items():
                        if _floating_torch_name(sub_value) and sub_value != torch_name:
                            value[sub] = torch_name
                            changed.append((f"{path}.{sub}", sub_value))
                    continue
            if isinstance(value, (dict, list)):
                stack.append((path, value))
    changed.sort()
    return changed


def _floating_torch_name(value: Any) -> bool:
    """"float32", "bfloat16", ... as transformers writes a torch dtype (str(torch.float32) without "torch.")."""
    if not isinstance(value, str):
        return False
    name = value.removeprefix("torch.")
    return name in dtypes.TORCH_DTYPE_NAMES and dtypes.from_torch(name).is_float


@dataclass
class Reference:
    """What `--like HF_DIR` holds: tensor name -> (shape, dtype), whether it ties the embeddings, its files."""

    path: str
    tensors: dict[str, tuple[tuple[int, ...], str]]
    ties_embeddings: bool
    companions: list[str]
    storage: Storage


def load_reference(path: str) -> Reference:
    """The reference directory's tensors (metadata only) and companion files."""
    from ..formats import open_checkpoint

    ckpt = open_checkpoint(path)
    storage = Storage.open(path)
    tensors = {leaf.name: (tuple(leaf.shape), leaf.dtype) for leaf in ckpt.arrays()}
    if not tensors:
        raise CkptError("--like: the reference holds no tensors (it must be a model directory with its weights)", path)
    return Reference(path, tensors, _ties(storage), companion_files(storage), storage)


def _ties(storage: Storage) -> bool:
    """config.json's tie_word_embeddings (transformers' default: True)."""
    if "config.json" not in storage.listdir()[1]:
        return False
    try:
        config = json.loads(storage.read("config.json"))
    except RecursionError:  # json's C parser recurses per level: a file of '[' is not a config
        raise CkptError("config.json nests too deeply to be a model config", f"{storage.url}/config.json") from None
    except (ValueError, UnicodeDecodeError):
        raise CkptError("config.json is not valid JSON", f"{storage.url}/config.json") from None
    if not isinstance(config, dict):
        return False
    tie = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True)
                     if isinstance(config.get("text_config"), dict) else True)
    return tie is True


@dataclass
class LikeCheck:
    differences: list[str] = field(default_factory=list)
    tied_dropped: list[str] = field(default_factory=list)  # output names left out: tied in the reference


def check_like(targets: dict[str, tuple[tuple[int, ...], str]], ref: Reference,
               dtype: str | None = None) -> LikeCheck:
    """The output's tensors (name -> (shape, dtype)) against the reference's, every difference named.

    `dtype` (an explicit --dtype): the dtype change is intended, so names and shapes are checked
    against the reference and each dtype against the reference's tensor cast by the --dtype rule
    (core/casting.py: a floating weight becomes `dtype`; a step counter, an integer tensor stays)."""
    out = LikeCheck()
    for name, (shape, have) in targets.items():
        want = ref.tensors.get(name)
        if want is None:
            if ref.ties_embeddings and name in TIED_OUTPUT_NAMES and _has_embedding(ref, shape):
                out.tied_dropped.append(name)
                continue
            out.differences.append(f"{name}: in the output, not in the reference")
        elif want[0] != shape:
            out.differences.append(f"{name}: shape {list(shape)}, the reference has {list(want[0])}")
        elif dtype is None and want[1] != have:
            out.differences.append(f"{name}: dtype {have}, the reference has {want[1]} (--dtype casts)")
        elif dtype is not None and _cast(name, want, dtype) != have:
            out.differences.append(f"{name}: dtype {have}, the reference's {want[1]} is {_cast(name, want, dtype)} "
                                   f"after --dtype {dtype}")
    for name in ref.tensors:
        if name not in targets:
            out.differences.append(f"{name}: in the reference, not in the output")
    return out


def _cast(name: str, tensor: tuple[tuple[int, ...], str], dtype: str) -> str:
    """The dtype `--dtype dtype` gives the reference's tensor `name` (the rule convert casts the output by)."""
    from ..core import casting  # (numpy: only a convert with --like and --dtype needs it)

    shape, have = tensor
    return have if casting.kept_reason((name,), math.prod(shape), have, dtype) is not None else dtype


def _has_embedding(ref: Reference, shape: tuple[int, ...]) -> bool:
    """An input embedding of that shape (its dtype, if it differs, is a difference of its own)."""
    return any(n.endswith("embed_tokens.weight") and s[0] == shape for n, s in ref.tensors.items())


class LikeMismatchError(CkptError):
    """The output would not match the --like reference: every difference, nothing written."""

    code = "like-mismatch"

    def __init__(self, differences: list[str], where: str) -> None:
        self.details = tuple(differences)
        first = differences[0]
        more = f" (and {len(differences) - 1} more: listed above)" if len(differences) > 1 else ""
        super().__init__(
            f"the output would not match the reference's tensors: {first}{more}; nothing was written "
            "(--force-like writes it anyway)", where,
        )


def describe(check: LikeCheck) -> dict[str, Any]:
    return {"differences": check.differences, "tied_dropped": check.tied_dropped}


def model_files(src: Checkpoint, plan: WritePlan, skipped: list[tuple[str, str]],
                opts: ConvertOptions) -> tuple[tuple[Storage, list[str]] | None, list[str]]:
    """The model's non-weight files to copy beside the output, and --force-like's differences.

    --like HF_DIR: the plan's tensors checked against the reference's (every difference, or
    LikeMismatchError), its tied output embedding dropped, its files copied. Without it, a
    source that is a Hugging Face model directory brings its own files to a target that takes them.
    """
    takes = opts.to in formats.taking("like")
    if opts.like is None:
        if opts.force_like:
            raise UsageError("--force-like needs --like HF_DIR")
        local = Storage.open(src.path) if takes and not formats.split_file(src.path) else None
        if local is not None and is_model_directory(local):
            return (local, companion_files(local)), []
        return None, []
    if not takes:
        raise UsageError(f"--like makes a Hugging Face model directory: use it with --to "
                         f"{formats.joined(formats.taking('like'))}")
    ref = load_reference(opts.like)
    check = check_like({t.name: (tuple(t.shape), t.dtype) for t in plan.arrays()}, ref, opts.dtype)
    if check.differences and not opts.force_like:
        raise LikeMismatchError(check.differences, opts.like)
    if check.tied_dropped:
        dropped = set(check.tied_dropped)
        plan.targets = [t for t in plan.targets if not (isinstance(t, TargetArray) and t.name in dropped)]
        skipped.extend((name, f"tied to the input embedding in {opts.like} (its config ties them)")
                       for name in check.tied_dropped)
    return (ref.storage, ref.companions), check.differences
