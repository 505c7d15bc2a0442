"""sitecustomize for the processes `autopatch run` starts: `autopatch run` puts this folder first on
PYTHONPATH, so every Python child (subprocess, multiprocessing spawn/forkserver, torchrun ranks)
runs this file at start-up. It starts autopatch (autopatch._startup: near-free when no variable is
set, never raises) and then runs the sitecustomize this file shadows, if there is one (Debian ships
one), found on sys.path without this folder. Children started with -E, -I or -S are not reached."""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import autopatch._startup  # noqa: F401
except Exception:
    pass  # autopatch not importable in this interpreter: run unpatched, like plain python


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    # From here on `sitecustomize` is the shadowed module, as it would have been without us.
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_chain()
