"""What a directory that no reader claims holds, said in one line.

The registry's last word when detection fails: checkpoints one level down
(a directory of step directories: name them and say how to pick one), or
files ckpt recognises but does not read (naming their format), or just the
first few names.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from ..errors import CkptError
from ..storage import Storage

_MAX_SUBDIRS = 64
_STEPISH = re.compile(r"^(?:.*\D)?(\d+)$")

# file names of formats ckpt does not read, by the way their writers name them
_OTHER_FORMATS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\.index$|\.data-\d+-of-\d+$"), "TensorFlow checkpoint files"),
    (re.compile(r"\.(pt|pth|bin)$"), "torch.save files"),
    (re.compile(r"\.safetensors$"), "safetensors files"),
    (re.compile(r"\.(npz|npy)$"), "numpy files"),
    (re.compile(r"\.(h5|hdf5|keras)$"), "HDF5 / Keras files"),
    (re.compile(r"\.(msgpack|mpk)$"), "msgpack files"),
]


def describe(storage: Storage, formats: Iterable[str], module: Callable[[str], Any]) -> str:
    dirs, files = storage.listdir()
    found = []
    for d in dirs[:_MAX_SUBDIRS]:
        try:
            sub = storage.child(d)
            for name in formats:
                if module(name).detect(sub):
                    found.append((d, name))
                    break
        except CkptError:
            continue
    if found:
        steps = [(d, f) for d, f in found if _STEPISH.match(d)]
        listed = ", ".join(f"{d}/ ({f})" for d, f in found[:6]) + (", ..." if len(found) > 6 else "")
        example = f"{storage.url}/{found[-1][0]}"
        if steps and len(steps) == len(found):
            return (
                f"a directory of {len(found)} step directories, not one checkpoint: {listed}; "
                f"open one, e.g. ckpt inspect {example}"
            )
        return f"a directory of {len(found)} checkpoints, not one: {listed}; open one, e.g. ckpt inspect {example}"
    kinds = sorted({kind for f in files for rx, kind in _OTHER_FORMATS if rx.search(f)})
    if kinds:
        names = ", ".join(sorted(files)[:5])
        return f"not a checkpoint format ckpt reads: found {' and '.join(kinds)} ({names})"
    seen = ", ".join(sorted(files)[:5]) or ("only directories: " + ", ".join(dirs[:5]) if dirs else "nothing")
    return f"not an Orbax or torch.distributed.checkpoint checkpoint, nor a Flax / T5X msgpack one (found {seen})"
