"""sitecustomize for the processes `autopatch run` starts: `autopatch run` puts this folder first on
PYTHONPATH, so every Python child (subprocess, multiprocessing spawn/forkserver, torchrun ranks)
runs this file at start-up. It starts autopatch (autopatch._startup: near-free when no variable is
set, never raises) and then runs the sitecustomize this file shadows, if there is one (Debian ships
one), found on sys.path without this folder. Children started with -E, -I or -S are not reached."""

import importlib.machinery
import importlib.util
import os
import sys

def _start() -> None:
    try:
        import autopatch._startup  # noqa: F401
        return
    except ImportError:
        pass
    except Exception:
        return  # never break the interpreter's start
    # Not importable from this child's path: `autopatch run` was started from a source checkout that
    # is neither installed nor on PYTHONPATH (python -m autopatch found it in the working directory,
    # which a child running a script does not have). This file lies in <root>/autopatch/_launcher:
    # <root> is where autopatch (and fused_kernels) come from. Appended, so it shadows nothing.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(root, "autopatch", "_startup.py")) and root not in sys.path:
        sys.path.append(root)
        try:
            import autopatch._startup  # noqa: F401
        except Exception:
            pass  # run unpatched, like plain python


_start()


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
