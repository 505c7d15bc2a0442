"""The one place that swaps attributes on classes and modules. Rules never setattr directly: going
through here keeps the original for the fallback path, makes patching idempotent, lets the audit
(autopatch.audit) tell whether what we set is still there, and lets tests restore everything.

A function replaced by a function (a class's `forward`, a module's `apply_rotary_pos_emb`) is set as a
wrapt function wrapper around the original (`Swap`): calls go to our function, while `__wrapped__`,
`__name__`, `__doc__`, `inspect.signature` and `inspect.unwrap` read the original's, as a decorator's
would. torch.compile(fullgraph=True) traces through it without a graph break (Dynamo inlines the
wrapper's call: tests/test_patching_wrapt.py compiles a patched tiny Llama with backend "eager"). What
we attach to our function (a rule's `_autopatch_variant`) is read through `replacement(value)`.
Anything else (properties, classes, None, a registry entry) is set as given. wrapt is imported on the
first swap, which comes after transformers was imported: never at interpreter start.
"""

from __future__ import annotations

import threading
import types

_MISSING = object()
# (id(owner), name) -> (owner, name, original value or _MISSING, the value we set)
_originals: dict[tuple[int, object], tuple[object, object, object, object]] = {}
_lock = threading.RLock()
_swap_class = []  # the wrapt class, made on first use


def _swap_type():
    if not _swap_class:
        import wrapt

        class Swap(wrapt.FunctionWrapper):
            """A function patched by autopatch: calls go to `_self_replacement`; the rest reads the original."""

            def __init__(self, original, replacement):
                super().__init__(original, _caller(replacement))
                self._self_replacement = replacement

        _swap_class.append(Swap)
    return _swap_class[0]


def _caller(replacement):
    """The wrapt wrapper of one swap: wrapt hands over the owner as `instance` for a method called on
    an instance (or through the class with the instance first), None for a module function."""

    def call(wrapped, instance, args, kwargs):
        if instance is None:
            return replacement(*args, **kwargs)
        return replacement(instance, *args, **kwargs)

    return call


def replacement(value):
    """Our function behind a Swap (what a rule set), else `value` itself."""
    return getattr(value, "_self_replacement", value)


def is_swap(value) -> bool:
    return bool(_swap_class) and isinstance(value, _swap_class[0])


def is_patched(owner, name: str) -> bool:
    with _lock:
        return (id(owner), name) in _originals


def original(owner, name: str):
    """The value `owner.name` had before we patched it (the current value if never patched).
    Reads the owner's own __dict__ when it has one, so an inherited method is reported as missing."""
    with _lock:
        entry = _originals.get((id(owner), name))
    if entry is not None:
        value = entry[2]
        if value is _MISSING:
            raise AttributeError(f"{owner!r} had no attribute {name!r} of its own before patching")
        return value
    return getattr(owner, name)


def installed(owner, name: str):
    """The value we set as `owner.name` (a Swap for a swapped function), or None if not patched."""
    with _lock:
        entry = _originals.get((id(owner), name))
    return None if entry is None else entry[3]


def entries() -> list[tuple[object, str, object]]:
    """(owner, name, the value we set) of every attribute patch in force (the audit's list)."""
    with _lock:
        return [(owner, name, new) for owner, name, _, new in _originals.values() if isinstance(name, str)]


def _wrap(owner, name: str, new, own):
    """`new` as a Swap around the function it replaces, where both are plain Python functions."""
    current = own if own is not _MISSING else getattr(owner, name, None)
    if not (isinstance(new, types.FunctionType) and isinstance(current, types.FunctionType)):
        return new
    return _swap_type()(current, new)


def replace(owner, name: str, new) -> bool:
    """Set owner.name = new (wrapped, see the module docstring), remembering the first original.
    Returns False when already patched."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:
            return False
        own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        value = _wrap(owner, name, new, own)
        _originals[key] = (owner, name, own, value)
        setattr(owner, name, value)
        return True


def replace_item(mapping: dict, key, new) -> bool:
    """Set mapping[key] = new (a registry dict shared by many objects, e.g. transformers' attention
    functions), remembering the first original. Returns False when already patched."""
    with _lock:
        entry_key = (id(mapping), ("item", key))
        if entry_key in _originals:
            return False
        _originals[entry_key] = (mapping, ("item", key), mapping.get(key, _MISSING), new)
        mapping[key] = new
        return True


def is_item_patched(mapping: dict, key) -> bool:
    with _lock:
        return (id(mapping), ("item", key)) in _originals


def restore_all() -> None:
    """Undo every patch (tests; never called in normal use)."""
    with _lock:
        keys = list(_originals)
    restore(keys)


def patched_keys() -> set:
    """The (id(owner), name) keys of every patch in force (rules/__init__ tracks which rule made which)."""
    with _lock:
        return set(_originals)


def restore(keys) -> None:
    """Undo the patches with these keys (from patched_keys), leaving the others in force."""
    with _lock:
        for key in keys:
            entry = _originals.pop(key, None)
            if entry is None:
                continue
            owner, name, value, _ = entry
            if isinstance(name, tuple):  # replace_item: a mapping's entry
                if value is _MISSING:
                    owner.pop(name[1], None)
                else:
                    owner[name[1]] = value
            elif value is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, value)
