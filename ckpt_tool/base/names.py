"""Names ckpt gives its own files, which every layer must tell from a checkpoint's,
and the one spelling of a leaf's key path that every command shows and reads.

A leaf is addressed by its tuple of keys (`model.ArrayLeaf.keys`); two leaves
are the same leaf only when their keys, each taken as text, are equal. Where a
key path has to be one string (the tree view and flat listing of inspect, a
`--filter`/`--select` glob, a `--rename` rule, diff's report and `--json`),
the keys are joined by `/` with one reversible escape, the same in every format:

- `%` in a key is written `%25` and `/` in a key is written `%2F`;
- nothing else changes, so the common keys (`params/dense/kernel`,
  `model/layers/0/weight`) read as they always did.

`split_path(join_keys(keys)) == tuple(str(k) for k in keys)` for every key
tuple, so two different key paths never share a joined spelling: a safetensors
tensor named `a/b` is `a%2Fb`, not the `a/b` of the tensor `a.b` (keys
`("a", "b")`). The spelling is for display and matching only: every output
keeps the source's own names (the tensor is still written as `a/b`).
"""

# temporary output directories of convert/reshard carry this in their name
TMP_MARKER = ".ckpt-tmp"
# the owner record of a convert/reshard's output: the first file of a local temporary directory,
# and at an object-store destination, while a run writes it (ops/destination.py, ops/destination_remote.py)
OWNER_FILE = ".ckpt-owner.json"

# the joiner of key paths, and the escapes of the two characters that make it reversible
SEPARATOR = "/"
_ESCAPES = (("%", "%25"), ("/", "%2F"))


def escape_key(key: object) -> str:
    """One key as it appears in a joined key path: `%` -> `%25`, `/` -> `%2F`."""
    text = str(key)
    if "%" in text or "/" in text:  # (most keys hold neither: no copies made)
        for raw, escaped in _ESCAPES:
            text = text.replace(raw, escaped)
    return text


def unescape_key(text: str) -> str:
    """The key a joined path's part spells (escape_key's inverse; an unknown `%xx` stays as it is)."""
    if "%" not in text:
        return text
    out = []
    i = 0
    while i < len(text):
        if text.startswith("%2F", i) or text.startswith("%2f", i):
            out.append("/")
            i += 3
        elif text.startswith("%25", i):
            out.append("%")
            i += 3
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def join_keys(keys: "tuple[object, ...] | list[object]") -> str:
    """A key path as one string: its keys escaped and joined by `/` (reversible: split_path)."""
    parts = [k if type(k) is str else str(k) for k in keys]
    text = SEPARATOR.join(parts)
    # (every leaf's path is asked for, often: when no key holds a '/' or a '%', the plain join is it)
    if "%" not in text and text.count(SEPARATOR) == len(parts) - 1:
        return text
    return SEPARATOR.join(escape_key(p) for p in parts)


def split_path(path: str) -> tuple[str, ...]:
    """The keys (as text) of a joined key path; the empty path is the empty tuple."""
    if not path:
        return ()
    return tuple(unescape_key(p) for p in path.split(SEPARATOR))


def key_text(keys: "tuple[object, ...] | list[object]") -> tuple[str, ...]:
    """A key path's identity: its keys as text (a list index 0 and a dict key "0" are one key,
    as every format's loader treats them: both are written as `0`)."""
    return tuple(str(k) for k in keys)


def dotted_name(keys: "tuple[object, ...] | list[object]") -> str:
    """The keys joined by '.', as a torch FQN or a flat tensor name is spelled (not reversible:
    `("a.b",)` and `("a", "b")` share it; a writer that names leaves so must refuse that pair)."""
    return ".".join(str(k) for k in keys)
