"""The libraries' OWN view of a checkpoint, to compare ckpt's reader against.

Everything here goes through orbax-checkpoint / torch.distributed.checkpoint
themselves; jax, orbax and torch are imported lazily inside the functions so
that importing this module is free (ckpt itself must never import them).

Key paths
---------
Every function returns dicts keyed by a *key path*: a tuple whose elements are

* ``str``  - a dict key, exactly as written (``'model.w'`` stays one element;
  a dict key that happens to be ``'0'`` stays the string ``'0'``);
* ``int``  - a list/tuple index.

Orbax: the key path is jax's ``tree_flatten_with_path`` path of the tree that
orbax's metadata/restore returns (``DictKey`` -> its key, ``SequenceKey`` ->
its index).  Orbax restores tuples as lists, and its ``_METADATA`` records
sequence indices as strings with ``key_type`` 1: those come back here as ints.

DCP: the key path is ``metadata.planner_data[fqn]``, the tuple DCP's
``flatten_state_dict`` recorded at save time.  In torch 2.13 list indices are
recorded as ``int`` and dict keys as ``str`` (so ``history.0`` ->
``('history', 0)`` for a list but ``model.layers.0.w`` ->
``('model', 'layers', '0', 'w')`` for a dict keyed ``'0'``).  The elements are
kept as they are: int stays int, str stays str, anything else becomes str.
A list that holds no tensor is NOT flattened by DCP: it is one bytes item
(e.g. ``('milestones',)``).  If a checkpoint has no planner_data entry for an
fqn (custom planner, flatten disabled) the key is ``(fqn,)``.

dtype names are numpy / ml_dtypes names: 'float32', 'bfloat16', 'float16',
'float8_e4m3fn', 'int64', 'uint8', 'bool', ...; orbax strings are 'string'.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

KeyPath = tuple
ShapeDtype = tuple  # (shape tuple, dtype name)

TMP_SUFFIX = ".orbax-checkpoint-tmp"


# --------------------------------------------------------------------------
# orbax
# --------------------------------------------------------------------------


def _abs(path) -> str:
    # Orbax / tensorstore misbehave on relative paths (Checkpointer.metadata()
    # silently returns item_metadata=None for a relative OCDBT path).
    return os.path.abspath(os.fspath(path))


def _is_pytree_item(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "_METADATA"))


def _composite_items(path: str) -> dict[str, str] | None:
    """For a CheckpointManager step dir: {item name: item dir}; else None.

    An unfinished step keeps its items as ``<item>.orbax-checkpoint-tmp``.
    """
    meta_file = os.path.join(path, "_CHECKPOINT_METADATA")
    if not os.path.isfile(meta_file) or _is_pytree_item(path):
        return None
    with open(meta_file) as f:
        handlers = json.load(f).get("item_handlers")
    if not isinstance(handlers, dict):
        return None
    items = {}
    for name in sorted(handlers):
        for cand in (name, name + TMP_SUFFIX):
            d = os.path.join(path, cand)
            if os.path.isdir(d):
                items[name] = d
                break
    return items


def _keypath(jax_path) -> KeyPath:
    import jax

    out = []
    for k in jax_path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(int(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(int(k.key))
        else:  # pragma: no cover - future key kinds
            out.append(str(k))
    return tuple(out)


def _flatten(tree) -> dict[KeyPath, Any]:
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_keypath(p): v for p, v in leaves}


def _pytree_metadata(item_dir: str):
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()
    try:
        md = handler.metadata(epath.Path(item_dir))
    finally:
        handler.close()
    return getattr(md, "tree", md)


def _leaf_shape_dtype(m) -> ShapeDtype:
    import numpy as np
    from orbax.checkpoint import metadata as ocpmd

    if isinstance(m, ocpmd.StringMetadata):
        return ((), "string")
    if isinstance(m, (ocpmd.ArrayMetadata, ocpmd.ScalarMetadata)):
        shape = tuple(int(d) for d in (m.shape or ()))
        return (shape, np.dtype(m.dtype).name)
    raise TypeError(f"unexpected orbax metadata leaf {type(m).__name__}: {m!r}")


def _pytree_reference(item_dir: str) -> dict[KeyPath, ShapeDtype]:
    return {k: _leaf_shape_dtype(m) for k, m in _flatten(_pytree_metadata(item_dir)).items()}


def orbax_reference(path) -> dict[KeyPath, ShapeDtype]:
    """{key path: (shape, dtype name)} from orbax's own metadata API.

    ``path`` is a PyTree/Standard checkpoint directory (it has ``_METADATA``),
    or a CheckpointManager STEP directory (``root/2``, also an unfinished
    ``root/3.orbax-checkpoint-tmp``), whose pytree items are returned under
    ``(item_name, *key)``.  JSON items carry no array metadata in orbax and are
    left out (``orbax_values`` includes them).  Strings -> ((), 'string');
    scalars -> ((), numpy dtype name of the saved value, e.g. 'int64').
    A CheckpointManager ROOT is rejected: use ``orbax_manager_reference``.
    """
    path = _abs(path)
    if _is_pytree_item(path):
        return _pytree_reference(path)
    items = _composite_items(path)
    if items is None:
        raise ValueError(
            f"{path} is neither an orbax pytree checkpoint nor a CheckpointManager "
            "step directory (for a manager root use orbax_manager_reference)"
        )
    out: dict[KeyPath, ShapeDtype] = {}
    for name, item_dir in items.items():
        if _is_pytree_item(item_dir):
            for k, v in _pytree_reference(item_dir).items():
                out[(name,) + k] = v
    return out


def _restore_pytree(item_dir: str) -> dict[KeyPath, Any]:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp
    from etils import epath
    from orbax.checkpoint import metadata as ocpmd

    md_tree = _pytree_metadata(item_dir)

    def restore_args(m):
        if isinstance(m, ocpmd.ArrayMetadata):
            # numpy on the host: no devices / shardings needed, so this works
            # on one process for checkpoints written by many.
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.RestoreArgs()

    args = jax.tree_util.tree_map(restore_args, md_tree)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        restored = handler.restore(
            epath.Path(item_dir), args=ocp.args.PyTreeRestore(restore_args=args)
        )
    finally:
        handler.close()
    kinds = _flatten(md_tree)
    out = {}
    for k, v in _flatten(restored).items():
        if isinstance(kinds.get(k), ocpmd.ScalarMetadata) and isinstance(v, (np.ndarray, np.generic)):
            v = v.item()  # python int / float / bool
        out[k] = v
    return out


def _restore_json(item_dir: str) -> dict[KeyPath, Any]:
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.JsonCheckpointHandler()
    try:
        obj = handler.restore(epath.Path(item_dir))
    finally:
        handler.close()
    return _flatten_plain(obj)


def _flatten_plain(obj, prefix: KeyPath = ()) -> dict[KeyPath, Any]:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten_plain(v, prefix + (k,)))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(_flatten_plain(v, prefix + (i,)))
        return out
    return {prefix: obj}


def orbax_values(path) -> dict[KeyPath, Any]:
    """{key path: value}: a full restore with orbax itself.

    Arrays come back as numpy arrays (bfloat16 as ml_dtypes.bfloat16), scalars
    as Python int/float/bool, strings as str.  ``path`` as for
    ``orbax_reference``; for a step directory every item is included under
    ``(item_name, *key)``, JSON items flattened (dict keys str, list indices
    int).
    """
    path = _abs(path)
    if _is_pytree_item(path):
        return _restore_pytree(path)
    items = _composite_items(path)
    if items is None:
        raise ValueError(f"{path} is not an orbax pytree checkpoint or manager step dir")
    out: dict[KeyPath, Any] = {}
    for name, item_dir in items.items():
        vals = _restore_pytree(item_dir) if _is_pytree_item(item_dir) else _restore_json(item_dir)
        for k, v in vals.items():
            out[(name,) + k] = v
    return out


def orbax_manager_reference(root) -> dict[str, Any]:
    """What orbax's CheckpointManager itself says about a manager root.

    {'steps': finalized steps, 'latest_step': int|None,
     'tmp_dirs': names of unfinished (temporary) step dirs,
     'root_metadata': custom root metadata dict (or None)}
    """
    import orbax.checkpoint as ocp

    root = _abs(root)
    mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        steps = [int(s) for s in mgr.all_steps()]
        latest = mgr.latest_step()
        try:
            md = mgr.metadata()
            root_md = dict(md.custom_metadata) if getattr(md, "custom_metadata", None) else None
        except Exception:  # noqa: BLE001 - no root metadata
            root_md = None
    finally:
        mgr.close()
    return {
        "steps": sorted(steps),
        "latest_step": None if latest is None else int(latest),
        "tmp_dirs": sorted(ocp.path.step.tmp_checkpoints(root)),
        "root_metadata": root_md,
    }


# --------------------------------------------------------------------------
# torch.distributed.checkpoint
# --------------------------------------------------------------------------


def _dcp_metadata(path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(os.fspath(path)).read_metadata()


def _dcp_keymap(md) -> dict[str, KeyPath]:
    planner = getattr(md, "planner_data", None) or {}
    out = {}
    for fqn in md.state_dict_metadata:
        raw = planner.get(fqn)
        if raw is None:
            out[fqn] = (fqn,)
        else:
            out[fqn] = tuple(e if isinstance(e, (int, str)) and not isinstance(e, bool) else str(e) for e in raw)
    return out


def _torch_dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dcp_reference(path) -> dict[KeyPath, ShapeDtype | None]:
    """{key path: (shape, dtype name)} for tensors, None for bytes items."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _dcp_metadata(path)
    keys = _dcp_keymap(md)
    out: dict[KeyPath, ShapeDtype | None] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[keys[fqn]] = (
                tuple(int(d) for d in item.size),
                _torch_dtype_name(item.properties.dtype),
            )
        else:
            out[keys[fqn]] = None
    return out


def dcp_keys(path) -> dict[str, KeyPath]:
    """{fqn: key path} - how dcp_reference keys map back to DCP fqns."""
    return _dcp_keymap(_dcp_metadata(path))


def dcp_chunks(path) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """{fqn: [(offsets, sizes), ...]} for every tensor, in metadata order.

    Chunks may be empty (a DTensor shard of size 0 on some rank is recorded as
    e.g. offsets (1, 0), sizes (0, 3)).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = _dcp_metadata(path)
    out = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[fqn] = [
                (tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                for c in item.chunks
            ]
    return out


def dcp_storage(path) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """{(fqn, chunk offsets or None for bytes): (file, byte offset, length)}."""
    md = _dcp_metadata(path)
    out = {}
    for idx, info in md.storage_data.items():
        offs = None if idx.offset is None else tuple(int(o) for o in idx.offset)
        out[(idx.fqn, offs)] = (info.relative_path, int(info.offset), int(info.length))
    return out


def _tensor_to_numpy(t):
    import ml_dtypes
    import numpy as np
    import torch

    t = t.detach().cpu()
    name = _torch_dtype_name(t.dtype)
    if hasattr(ml_dtypes, name) and not hasattr(np, name):
        # bfloat16 / float8_*: reinterpret the bits through a same-width int
        bits = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return t.contiguous().view(bits).numpy().view(getattr(ml_dtypes, name))
    return t.numpy().copy()


def dcp_values(path) -> dict[KeyPath, Any]:
    """{key path: value}: a full load with torch itself.

    Runs ``dcp_to_torch_save`` into a temporary file and ``torch.load``s it.
    Tensors -> numpy arrays (bfloat16/float8 as ml_dtypes arrays), bytes items
    -> the unpickled Python object (ints, floats, str, lists, tuples...).
    Keys are the same as dcp_reference's.
    """
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    md = _dcp_metadata(path)
    keys = _dcp_keymap(md)
    with tempfile.TemporaryDirectory(prefix="ckpt-dcp-ref-") as tmp:
        out_file = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(os.fspath(path), out_file)
        sd = torch.load(out_file, weights_only=False)
    out = {}
    for fqn, kp in keys.items():
        if kp == (fqn,) and fqn in sd:
            obj = sd[fqn]
        else:
            obj = sd
            for k in kp:
                obj = obj[k]
        out[kp] = _tensor_to_numpy(obj) if isinstance(obj, torch.Tensor) else obj
    return out


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------

FIXTURES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES_DIR, name)
