"""The one place that swaps attributes on classes and modules. Rules never setattr directly: going
through here keeps the original for the fallback path, makes patching idempotent, lets the audit
(autopatch.audit) tell whether what we set is still there, and lets tests restore everything.

What a rule gives is set as a plain function, with `__wrapped__` pointing at the original when the rule
did not set it (so `inspect.signature` and `inspect.unwrap` read the original's), not as a wrapt
function wrapper. Measured with torch 2.13 and wrapt 2.5: a patched tiny Llama whose forwards were
`wrapt.FunctionWrapper`s compiled with fullgraph=True in eval (backend "eager"), but a training step
under backend "aot_eager" (tests/test_stack_compile.py) failed in Dynamo's guards: "Guard failed on the
same frame it was created ... ClosureGuardAccessor: Not a function on
dict(type(instance._modules['model']).__dict__)['forward'].__closure__" -- the proxy passes
isinstance(..., FunctionType) but is not a function, so the guard Dynamo built on its closure fails at
once. wrapt serves the import hooks (autopatch.hooks); the swaps stay plain functions, which Dynamo
traces without a graph break (tests/test_patching.py, tests/test_stack_compile.py).
"""

from __future__ import annotations

import threading
import types

_MISSING = object()
# (id(owner), name) -> (owner, name, original value or _MISSING, the value we set)
_originals: dict[tuple[int, object], tuple[object, object, object, object]] = {}
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


def installed(owner, name: str):
    """The value we set as `owner.name`, or None if not patched."""
    with _lock:
        entry = _originals.get((id(owner), name))
    return None if entry is None else entry[3]


def entries() -> list[tuple[object, str, object]]:
    """(owner, name, the value we set) of every attribute patch in force (the audit's list)."""
    with _lock:
        return [(owner, name, new) for owner, name, _, new in _originals.values() if isinstance(name, str)]


def _dress(new, own, owner, name: str):
    """Point a replacement function's __wrapped__ at the function it replaces, unless the rule did."""
    current = own if own is not _MISSING else getattr(owner, name, None)
    if isinstance(new, types.FunctionType) and callable(current) and "__wrapped__" not in vars(new):
        try:
            new.__wrapped__ = current
        except (AttributeError, TypeError):
            pass
    return new


def replace(owner, name: str, new) -> bool:
    """Set owner.name = new, remembering the first original. Returns False when already patched."""
    with _lock:
        key = (id(owner), name)
        if key in _originals:
            return False
        own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)
        value = _dress(new, own, owner, name)
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
