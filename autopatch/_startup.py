"""Entered from autopatch.pth in every interpreter of the environment, and from the launcher's
sitecustomize (autopatch/_launcher/) in the children of `autopatch run`.

With neither FUSED_KERNELS nor any AUTOPATCH_* variable set, and no ./autopatch.env (the default env
file: one stat of the working directory), it returns at once: it reads os.environ (already imported
by site) and imports nothing. Otherwise it puts autopatch.hooks' finder on
sys.meta_path, which imports nothing either (os, sys and threading, already loaded): no pydantic,
no wrapt, no torch. The settings are read and validated only when transformers is imported, so a
bad variable never disturbs a program that does not use transformers. It never raises: an
exception in a .pth line is printed as "Error processing line" and SystemExit there is a fatal
interpreter error. Importing it twice (CPython runs a venv's .pth files twice) does nothing the
second time: a module body runs once, and install() is idempotent.
"""

import os as _os


DEFAULT_ENV_FILE = "autopatch.env"  # autopatch.config.DEFAULT_ENV_FILE (not imported: pydantic)


def wanted(environ=None, cwd=None) -> bool:
    """Whether any variable asks for autopatch, or the default env file ./autopatch.env exists."""
    env = _os.environ if environ is None else environ
    if "FUSED_KERNELS" in env:
        return True
    for name in env:
        if name.startswith("AUTOPATCH_"):
            return True
    path = DEFAULT_ENV_FILE if cwd is None else _os.path.join(cwd, DEFAULT_ENV_FILE)
    try:
        return _os.path.isfile(path)
    except Exception:
        return False


def start() -> None:
    """Register the import hooks now (also for notebooks: after `%env FUSED_KERNELS=...`, call
    `import autopatch._startup as s; s.start()` before importing transformers models)."""
    try:
        from autopatch import hooks

        hooks.install()
    except Exception as exc:  # never break the interpreter's start
        try:
            import sys

            print(f"autopatch: could not set up the import hooks ({type(exc).__name__}: {exc}); "
                  "models will not be patched", file=sys.stderr)
        except Exception:
            pass


try:
    if wanted():
        start()
except Exception:
    pass
