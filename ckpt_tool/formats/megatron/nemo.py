"""NeMo 2 checkpoints: `<ckpt>/weights/` (a dist_checkpointing save) + `<ckpt>/context/` (the config).

NeMo 2's ModelCheckpoint writes a checkpoint directory holding (NVIDIA/NeMo, nemo/lightning):

  * `weights/`: MegatronCheckpointIO.save_checkpoint calls `dist_checkpointing.save(checkpoint,
    ckpt_to_weights_subdir(path))` (io/pl.py; WEIGHTS_PATH = "weights", ckpt_utils.py): an
    ordinary Megatron-Core save, read by save.read_save;
  * `context/`: TrainerContext.io_dump(<ckpt>/context, yaml_attrs=["model"]) (io/mixin.py):
    `io.json`, fiddle's JSON serialization of the trainer context's config, which NeMo's
    `load_context` turns back into objects by importing every class it names; `model.yaml`,
    nemo_run's YAML of the model's config (yaml.safe_dump: `_target_` class names, arguments
    with their defaults); artifacts (tokenizer files) beside them.

NeMo's own tools recognise the layout by `weights/` and `context/` both being there
(nemo/export/trt_llm/nemo_ckpt_loader/nemo_file.py) and read model.yaml with `yaml.safe_load`.
ckpt does the same: the weights as a Megatron save at the top of the tree, model.yaml's values
under `context/model/...` (PyYAML's safe_load: data only, no tag constructs an object), io.json
and the artifacts listed in a note, never executed.
"""
from __future__ import annotations

from typing import Any, Callable

from ...base.errors import CkptError, CorruptMetadataError, PathEscapeError
from ...core.model import Checkpoint, Key, Leaf, ValueLeaf, constant_loader
from ...storage import Storage

WEIGHTS = "weights"
CONTEXT = "context"
MODEL_YAML = "model.yaml"
IO_JSON = "io.json"
MAX_YAML_BYTES = 16 << 20
MAX_NODES = 1 << 20  # values and containers a model.yaml may unfold to (aliases are expanded)
MAX_DEPTH = 100


def is_nemo(storage: Storage, dirs: list[str]) -> bool:
    """`weights/` (holding a Megatron save's metadata.json) beside `context/`."""
    if WEIGHTS not in dirs or CONTEXT not in dirs:
        return False
    _, files = storage.listdir(WEIGHTS)
    return "metadata.json" in files or "common.pt" in files or ".metadata" in files


def _plain_tree(value: Any, where: str) -> Any:
    """model.yaml's document as a tree of fresh containers: aliases expanded within a node budget,
    a document that refers to itself refused (safe_load builds such cycles from `&a [*a]`)."""
    count = 0

    def walk(v: Any, depth: int, path: tuple[int, ...]) -> Any:
        nonlocal count
        count += 1
        if count > MAX_NODES:
            raise CorruptMetadataError(f"unfolds to more than {MAX_NODES:,} values (YAML aliases)", where)
        if depth > MAX_DEPTH:
            raise CorruptMetadataError(f"nested more than {MAX_DEPTH} levels deep", where)
        if isinstance(v, (dict, list, tuple)):
            if id(v) in path:
                raise CorruptMetadataError("refers to itself (a YAML alias inside its own anchor)", where)
            inner = path + (id(v),)
            if isinstance(v, dict):
                return {_key(k): walk(x, depth + 1, inner) for k, x in v.items()}
            return [walk(x, depth + 1, inner) for x in v]
        return v

    return walk(value, 0, ())


def _key(k: Any) -> Any:
    return k if type(k) in (str, int) else str(k)


def read_model_yaml(storage: Storage) -> Any:
    """context/model.yaml through PyYAML's safe_load (plain data), bounded in size and shape."""
    import yaml

    name = f"{CONTEXT}/{MODEL_YAML}"
    where = f"{storage.url}/{name}"
    size = storage.size(name)
    if size > MAX_YAML_BYTES:
        raise CorruptMetadataError(f"{size:,} bytes: more than a model config's {MAX_YAML_BYTES:,}", where)
    try:
        doc = yaml.safe_load(storage.read(name))
    except RecursionError:
        raise CorruptMetadataError("YAML nested too deeply", where) from None
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CorruptMetadataError(f"not YAML PyYAML's safe_load reads ({first[:100]})", where) from None
    return _plain_tree(doc, where)


_SCALAR_DTYPES = {bool: "bool", int: "int64", float: "float64"}


def _value_type(value: Any) -> str:
    if type(value) in (bool, int, float):
        return "scalar"
    if isinstance(value, str):
        return "string"
    return "object"


def _leaves(doc: Any, prefix: tuple[Key, ...], file: str) -> list[Leaf]:
    """A mapping by key (str/int keys), anything else one value: `context/model/config/num_layers`."""
    out: list[Leaf] = []

    def walk(v: Any, keys: tuple[Key, ...]) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, keys + (k,))
            return
        out.append(ValueLeaf(keys=keys, name=".".join(str(k) for k in keys), value_type=_value_type(v),
                             dtype=_SCALAR_DTYPES.get(type(v)), loader=constant_loader(v), extra={"file": file}))

    walk(doc, prefix)
    return out


def context_files(storage: Storage) -> list[str]:
    """Every file under context/ (relative to it)."""
    return [k[len(CONTEXT) + 1:] for k in storage.list(CONTEXT)]


def read(storage: Storage) -> Checkpoint:
    """A NeMo 2 checkpoint: its weights save, then model.yaml's values under context/model."""
    from .save import read_save  # (lazily: is_nemo, which detection asks, needs none of it)

    ck = read_save(storage.child(WEIGHTS))
    ck.path = storage.url
    files = context_files(storage)
    taken = {leaf.keys[0] for leaf in ck.leaves if leaf.keys}
    prefix: tuple[Key, ...] = (CONTEXT,) if CONTEXT not in taken else ("nemo", CONTEXT)
    if MODEL_YAML in files:
        ck.leaves += _leaves(read_model_yaml(storage), prefix + ("model",), f"{CONTEXT}/{MODEL_YAML}")
    others = [f for f in files if f != MODEL_YAML]
    ck.layout["nemo"] = {"weights": WEIGHTS, "context": sorted(files)}
    ck.notes.insert(0, f"NeMo 2 checkpoint: {WEIGHTS}/ read as a Megatron-Core save; {CONTEXT}/{MODEL_YAML} "
                    f"shown under {'/'.join(map(str, prefix))}/model"
                    + ("" if MODEL_YAML in files else f" (absent: no {MODEL_YAML})"))
    if others:
        listed = ", ".join(others[:8]) + (" ..." if len(others) > 8 else "")
        ck.notes.insert(1, f"{CONTEXT}/ also holds {listed}: listed, not read ({IO_JSON} is NeMo's fiddle "
                        "config, which NeMo's load_context rebuilds by importing the classes it names; ckpt never does)")
    return ck


# ---------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------
def check(storage: Storage, findings: Any, check_save: Callable[[Storage, Any], None], under: Callable[..., Any]) -> None:
    """weights/ checked as a Megatron save (its files named under weights/); context/: io.json there and
    JSON (NeMo's load_context reads it: `missing-file`, `bad-metadata`), model.yaml PyYAML's safe_load reads
    (`bad-metadata`; absent: a `missing-file` warning, as NeMo's restore does not need it, its exporters do)."""
    from ...machinery.arrays import schema

    check_save(storage.child(WEIGHTS), under(findings, WEIGHTS))
    files = context_files(storage)
    if IO_JSON not in files:
        findings.error("missing-file", "NeMo's load_context rebuilds the model's config from it",
                       file=f"{CONTEXT}/{IO_JSON}")
    else:
        try:
            schema.load_json(storage.read(f"{CONTEXT}/{IO_JSON}"), f"{CONTEXT}/{IO_JSON}", max_bytes=256 << 20)
        except PathEscapeError:
            raise
        except CkptError as exc:
            findings.error("bad-metadata", exc.message, file=f"{CONTEXT}/{IO_JSON}")
    if MODEL_YAML not in files:
        findings.warning("missing-file", "NeMo's exporters read the model config from it",
                         file=f"{CONTEXT}/{MODEL_YAML}")
        return
    try:
        doc = read_model_yaml(storage)
    except PathEscapeError:
        raise
    except CkptError as exc:
        findings.error("bad-metadata", exc.message, file=f"{CONTEXT}/{MODEL_YAML}")
        return
    if not isinstance(doc, dict) or "_target_" not in doc:
        findings.error("bad-metadata", "not a NeMo model config (a mapping with the model's _target_)",
                       file=f"{CONTEXT}/{MODEL_YAML}")
    findings.count("context_files", len(files))
