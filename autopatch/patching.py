"""The one place that swaps attributes on classes and modules. Rules never setattr directly: going
through here keeps the original for the fallback path, makes patching idempotent and lets tests
restore everything."""

from __future__ import annotations

import threading

_MISSING = object()
# (id(owner), name) -> (owner, name, original value or _MISSING)
_originals: dict[tuple[int, str], tuple[object, str, object]] = {}
_lock = threading.RLock()


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


def replace(owner, name: str, new) -> bool:
    """Set owner.name = new, remembering the first original. Returns False when already patched."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:
            return False
        own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        _originals[key] = (owner, name, own)
        setattr(owner, name, new)
        return True


def replace_item(mapping: dict, key, new) -> bool:
    """Set mapping[key] = new (a registry dict shared by many objects, e.g. transformers' attention
    functions), remembering the first original. Returns False when already patched."""
    with _lock:
        entry_key = (id(mapping), ("item", key))
        if entry_key in _originals:
            return False
        _originals[entry_key] = (mapping, ("item", key), mapping.get(key, _MISSING))
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
            owner, name, value = entry
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
