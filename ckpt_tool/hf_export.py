"""A complete Hugging Face export: the model's other files beside the weights, and `--like`.

`from_pretrained` needs more than the tensors: `config.json`, `generation_config.json`, the
tokenizer's files. Converting a Hugging Face directory to safetensors carries them over
(companion_files); from any other source (a Megatron or DCP checkpoint), `--like HF_DIR` names a
reference model directory: its companion files are copied, and the output must hold exactly
the reference's tensor names, shapes and dtypes, after --rename, --unstack and --dtype. Every
difference is listed and nothing is written when there is one (`--force-like` writes anyway).

Tied weights: transformers saves a model whose `config.json` says `tie_word_embeddings` (the
default for most architectures) without its output embedding (`lm_head.weight`), and ties it to
the input embedding on load. A source that stores both (a torch `.bin` or a Megatron checkpoint
with `untie_embeddings_and_output_weights=False`) has one tensor more than the reference: it is
left out, and reported as left out, when the reference ties them, does not hold it and holds an
input embedding of its shape; nothing else is ever dropped.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from typing import Any

from .errors import CkptError
from .storage import Storage

# top-level files of a Hugging Face model directory that are not weights (transformers' and
# tokenizers' names); training state beside them (optimizer.pt, trainer_state.json) is not the model's
COMPANIONS = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "tokenizer.model", "*.tiktoken", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json", "README.md", "LICENSE*", "NOTICE*",
)
MAX_COMPANION_BYTES = 1 << 30
# transformers' output embedding, tied to the input embedding when tie_word_embeddings holds
TIED_OUTPUT_NAMES = ("lm_head.weight",)


def companion_files(storage: Storage) -> list[str]:
    """The non-weight model files at the top of a Hugging Face directory."""
    _, files = storage.listdir()
    return sorted(f for f in files if any(fnmatch.fnmatchcase(f, p) for p in COMPANIONS))


def is_model_directory(storage: Storage) -> bool:
    """A Hugging Face model directory: a config.json beside the weights."""
    return "config.json" in storage.listdir()[1]


def copy_companions(src: Storage, names: list[str], dst: Storage) -> None:
    """Copy the companion files into the (temporary) output, each whole (they are small)."""
    for name in names:
        size = src.size(name)
        if size > MAX_COMPANION_BYTES:
            raise CkptError(f"{size} bytes: too large for a model's companion file", f"{src.url}/{name}")
        dst.write(name, src.read(name))


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
    from .formats import open_checkpoint

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


def check_like(targets: dict[str, tuple[tuple[int, ...], str]], ref: Reference) -> LikeCheck:
    """The output's tensors (name -> (shape, dtype)) against the reference's, every difference named."""
    out = LikeCheck()
    for name, (shape, dtype) in targets.items():
        want = ref.tensors.get(name)
        if want is None:
            if ref.ties_embeddings and name in TIED_OUTPUT_NAMES and _has_embedding(ref, shape):
                out.tied_dropped.append(name)
                continue
            out.differences.append(f"{name}: in the output, not in the reference")
        elif want[0] != shape:
            out.differences.append(f"{name}: shape {list(shape)}, the reference has {list(want[0])}")
        elif want[1] != dtype:
            out.differences.append(f"{name}: dtype {dtype}, the reference has {want[1]} (--dtype casts)")
    for name in ref.tensors:
        if name not in targets:
            out.differences.append(f"{name}: in the reference, not in the output")
    return out


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
