"""The command line: `python -m autopatch` (or the `autopatch` console script).

    autopatch run [--kernels LIST] [--env-file F] [--report F] [--strict] script.py args...
    autopatch run [...] -m module args...
    autopatch doctor [--kernels LIST] [--env-file F] [--all] [model_type ...]
    autopatch list
    autopatch kernel-repo

`run` behaves like `python script.py args...` (sys.argv, __main__, sys.path[0], exit code, uncaught
exceptions and their traceback) with the import hooks set. Its flags reach the script's process and
every child through environment variables (AUTOPATCH_RUN_KERNELS, AUTOPATCH_ENV_FILE,
AUTOPATCH_REPORT, AUTOPATCH_STRICT), and autopatch/_launcher (a sitecustomize) goes first on
PYTHONPATH so that children started by any means start patched.
"""

from __future__ import annotations

import argparse
import os
import sys

LAUNCHER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher")
USAGE_ERROR = 2

# doctor without model types: the architectures most people fine-tune (all ~540 take minutes).
DOCTOR_DEFAULT_MODEL_TYPES = (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "olmo2", "granite",
)


def _fail(command: str, message: str, code: int = USAGE_ERROR):
    print(f"autopatch {command}: {message}", file=sys.stderr)
    raise SystemExit(code)


# --------------------------------------------------------------------------- parsers
def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from autopatch.names import KERNEL_NAMES

    top = argparse.ArgumentParser(
        prog="autopatch",
        description="Put fused Triton kernels into Hugging Face Transformers models from environment variables.",
        epilog="Variables: FUSED_KERNELS, AUTOPATCH_<KERNEL>, AUTOPATCH_MODELS__<model_type>__<KERNEL>, "
        "AUTOPATCH_ENV_FILE, AUTOPATCH_REPORT, AUTOPATCH_STRICT (see README, Configuration).",
    )
    sub = top.add_subparsers(dest="command", metavar="{run,doctor,list,kernel-repo}")
    kernels_help = f"comma list of kernels: {', '.join(KERNEL_NAMES)}; or all, none, all,-rope"

    run = sub.add_parser(
        "run",
        help="run a script or module with the kernels patched in (children too)",
        usage="autopatch run [--kernels LIST] [--env-file F] [--report F] [--strict] "
        "(script.py | -m module) [args ...]",
        description="Run a Python script (or -m module) exactly as `python` would, with the import hooks "
        "set in its process and in every Python process it starts. Options go before the script; "
        "everything after the script (or after -m module) is the script's own argv.",
    )
    run.add_argument("--kernels", metavar="LIST", help=kernels_help + " (beats FUSED_KERNELS and AUTOPATCH_<KERNEL>)")
    run.add_argument("--env-file", metavar="F", help="env file to read (default: ./autopatch.env if it exists)")
    run.add_argument("--report", metavar="F", help="write what was patched as JSON at exit ({pid} expands)")
    run.add_argument("--strict", action="store_true", help="a refused candidate or a fallback to the original code is an error")
    run.add_argument("-m", dest="module", metavar="module", help="run a library module as a script, like python -m")

    doctor = sub.add_parser(
        "doctor",
        help="show, per component of the given architectures, what each rule patches or leaves alone and why",
        description="Import the modeling modules of the given model types (the model_type of their configs, "
        "e.g. llama gemma2 qwen3) and run the rules over them without building a model. Prints one table "
        "per module: kernel, target, and 'patched: <variant>' or 'left alone: <reason>'. Kernels: the "
        "configured ones (flags > environment > env file), or all when nothing is configured. Without "
        f"model types: {' '.join(DOCTOR_DEFAULT_MODEL_TYPES)}.",
    )
    doctor.add_argument("model_types", nargs="*", metavar="model_type", help="e.g. llama gemma2 qwen3")
    doctor.add_argument("--all", action="store_true", help="every modeling module of transformers (slow: minutes)")
    doctor.add_argument("--kernels", metavar="LIST", help=kernels_help)
    doctor.add_argument("--env-file", metavar="F", help="env file to read")

    sub.add_parser("list", help="print the kernel names and what each replaces",
                   description="Print the kernel names (for FUSED_KERNELS, AUTOPATCH_<KERNEL>, apply()) "
                   "and what each replaces.")
    sub.add_parser("kernel-repo", help="print the directory of autopatch's Hugging Face `kernels` layer repository",
                   description="Write (if needed) and print the directory of a local Hugging Face `kernels` layer "
                   "repository serving autopatch's kernels under the layer names transformers decorates "
                   "(RMSNorm, RMSNormZeroCentered, rotary_pos_emb), for KernelConfig(kernel_mapping={'RMSNorm': "
                   "f'{repo}:RMSNorm'}, use_local_kernel=True) or LOCAL_KERNELS. Directory: $AUTOPATCH_KERNEL_REPO, "
                   "else ~/.cache/autopatch/kernel-repo.")
    return top, {"run": run, "doctor": doctor}


# What a shell reports for a tool that SIGPIPE ended (`autopatch list | head`): 128 + SIGPIPE.
CLOSED_STDOUT = 141


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    top, subs = _parsers()
    if argv and argv[0] == "run":
        return _run(subs["run"], argv[1:])  # the script's own output: it meets a closed pipe as under python
    try:
        try:
            return _command(top, argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here rather than at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()


def _stdout_closed() -> int:
    """The reader of our stdout went away (`| head`): stop quietly, as command-line tools do. What is
    still buffered goes to /dev/null, so the interpreter's last flush has nothing to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return CLOSED_STDOUT


def _command(top: argparse.ArgumentParser, argv: list[str]):
    args = top.parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "list":
        return _list()
    if args.command == "kernel-repo":
        return _kernel_repo()
    top.print_help()
    return USAGE_ERROR


# --------------------------------------------------------------------------- kernel-repo
def _kernel_repo() -> int:
    from autopatch import hub

    try:
        print(hub.ensure_repo())
    except hub.RepoError as exc:
        _fail("kernel-repo", str(exc))
    return 0


# --------------------------------------------------------------------------- list
def _list() -> int:
    import textwrap

    from autopatch._api import APPLY_DEFAULTS
    from autopatch.names import KERNELS

    width = max(len(k) for k in KERNELS)
    for name, what in KERNELS.items():
        lines = textwrap.wrap(what, width=100 - width - 4) or [""]
        print(f"{name:<{width}}  {lines[0]}")
        for more in lines[1:]:
            print(f"{'':<{width}}  {more}")
    off = [k for k in KERNELS if not APPLY_DEFAULTS.get(k, False)]
    print()
    print("FUSED_KERNELS=all turns every kernel on; autopatch.apply(model) defaults to all but "
          + ", ".join(off) + " (Hugging Face's liger_kernel_config defaults).")
    return 0


# --------------------------------------------------------------------------- run
_VALUE_OPTIONS = ("--kernels", "--env-file", "--report")


def _split_run_argv(argv: list[str]):
    """autopatch's options | target. Returns (options, mode, target, target_args); mode is
    'script', 'module' or None (no target given)."""
    options: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if arg == "-m":
            if i + 1 >= len(argv):
                return options + [arg], None, None, []  # argparse says "expected one argument"
            return options, "module", argv[i + 1], argv[i + 2:]
        if arg.startswith("-m") and not arg.startswith("--"):
            return options, "module", arg[2:], argv[i + 1:]
        if arg in _VALUE_OPTIONS:
            options += argv[i:i + 2]
            i += 2
            continue
        if arg.startswith("-") and arg != "-":
            options.append(arg)
            i += 1
            continue
        break
    rest = argv[i:]
    if not rest:
        return options, None, None, []
    return options, "script", rest[0], rest[1:]


def _prepare_environment(args) -> None:
    """Flags -> environment variables, for this process and every child; launcher on PYTHONPATH."""
    from autopatch.config import DEFAULT_ENV_FILE, ConfigError, parse_kernel_list

    env = os.environ
    if args.kernels is not None:
        try:
            parse_kernel_list(args.kernels)
        except ValueError as exc:
            raise ConfigError(f"--kernels: {exc}") from None
        env["AUTOPATCH_RUN_KERNELS"] = args.kernels
    if args.env_file is not None:
        env["AUTOPATCH_ENV_FILE"] = os.path.abspath(args.env_file)
    elif env.get("AUTOPATCH_ENV_FILE", "").strip():
        env["AUTOPATCH_ENV_FILE"] = os.path.abspath(env["AUTOPATCH_ENV_FILE"].strip())
    elif os.path.isfile(DEFAULT_ENV_FILE):
        # absolute, so children that change directory read the same file
        env["AUTOPATCH_ENV_FILE"] = os.path.abspath(DEFAULT_ENV_FILE)
    if args.report is not None:
        env["AUTOPATCH_REPORT"] = os.path.abspath(args.report)
    if args.strict:
        env["AUTOPATCH_STRICT"] = "true"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != LAUNCHER_DIR]
    env["PYTHONPATH"] = os.pathsep.join([LAUNCHER_DIR, *parts])


def _run(parser: argparse.ArgumentParser, argv: list[str]):
    options, mode, target, target_args = _split_run_argv(argv)
    args = parser.parse_args(options)
    if args.module is not None:  # only reached as "-m" without a value, or mixed forms
        mode, target, target_args = "module", args.module, []
    if mode is None:
        parser.print_usage(sys.stderr)
        _fail("run", "give a script to run (script.py args...) or a module (-m module args...)")

    if mode == "script" and not os.path.exists(target):
        _fail("run", f"can't open file {os.path.abspath(target)!r}: [Errno 2] No such file or directory")

    from autopatch.config import ConfigError, load_settings

    try:
        _prepare_environment(args)
        # stop now, before the script runs, on any bad setting; the flags again, so that an error
        # names the flag rather than the variable it was copied to
        load_settings(kernels=args.kernels, env_file=args.env_file, report=args.report,
                      strict=True if args.strict else None)
    except ConfigError as exc:
        _fail("run", f"configuration error: {exc}")

    from autopatch import _startup

    _startup.start()
    if mode == "module":
        return _run_module(target, target_args)
    return _run_script(target, target_args)


def _set_path0(entry: str) -> None:
    """sys.path[0] as python sets it for a script (its folder) or -m (the working directory);
    sys.path[0] is ours now (the working directory, or the console script's folder). With -P
    (safe path) python adds nothing, and neither do we."""
    if getattr(sys.flags, "safe_path", False):
        return
    if sys.path:
        sys.path[0] = entry
    else:
        sys.path.insert(0, entry)


def _user_traceback(tb, skip_files):
    """Drop the leading frames that belong to autopatch run and runpy, as plain python shows none."""
    while tb is not None and tb.tb_frame.f_code.co_filename in skip_files:
        tb = tb.tb_next
    return tb


def _die_like_python(exc: BaseException, skip_files) -> None:
    """Print an uncaught exception as the interpreter does, then exit as it does (1, or by SIGINT
    for KeyboardInterrupt)."""
    # the default excepthook prints exc.__traceback__, whatever tb it is given
    exc.__traceback__ = _user_traceback(exc.__traceback__, skip_files)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    if isinstance(exc, KeyboardInterrupt):
        import atexit
        import signal

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    raise SystemExit(1)


def _run_script(script: str, script_args: list[str]):
    import builtins
    import runpy
    import types

    path = os.path.abspath(script)
    sys.argv = [script, *script_args]
    _set_path0(os.path.dirname(os.path.realpath(script)) if os.path.isfile(script) else path)
    keep = sys.modules.get("__main__")  # noqa: F841 - our own module stays alive while we run
    skip = {os.path.abspath(__file__), runpy.__file__, "<frozen runpy>"}
    if not os.path.isfile(path):  # a directory or zip file with __main__.py: runpy knows how
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit:
            raise
        except BaseException as exc:
            _die_like_python(exc, skip)
        return None

    import importlib.machinery

    with open(path, "rb") as fh:
        source = fh.read()
    try:
        code = compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:  # python shows the error without a traceback
        sys.excepthook(type(exc), exc, None)
        raise SystemExit(1)
    main_module = types.ModuleType("__main__")
    main_module.__file__ = path
    main_module.__cached__ = None
    main_module.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main_module.__spec__ = None
    main_module.__package__ = None
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module  # pickling by __main__ and multiprocessing spawn see the script
    try:
        exec(code, main_module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        _die_like_python(exc, skip)
    return None


def _run_module(module: str, module_args: list[str]):
    """What `python -m module` does: runpy._run_module_as_main (the function CPython's -m calls, so
    errors, argv[0] and tracebacks match), in a fresh __main__ module rather than ours."""
    import runpy
    import types

    sys.argv = ["-m", *module_args]  # runpy puts the module's file in argv[0], as python -m does
    _set_path0(os.getcwd())
    sys.modules["__main__"] = types.ModuleType("__main__")
    sys.modules["__main__"].__builtins__ = __import__("builtins")
    run_as_main = getattr(runpy, "_run_module_as_main", None)
    try:
        if run_as_main is not None:
            run_as_main(module, alter_argv=True)
        else:  # pragma: no cover - every CPython 3.x has it; public fallback
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise
    except BaseException as exc:
        _die_like_python(exc, {os.path.abspath(__file__)})
    return None


# --------------------------------------------------------------------------- doctor
def _doctor(args) -> int:
    from autopatch import hooks

    hooks.suspend()  # doctor runs the rules itself; the hooks would print and record twice
    from autopatch.config import ConfigError, _canonical, load_settings

    try:
        settings = load_settings(kernels=args.kernels, env_file=args.env_file)
    except ConfigError as exc:
        _fail("doctor", f"configuration error: {exc}")

    from autopatch.names import KERNEL_NAMES

    configured = settings.active()
    try:
        from transformers.models.auto import configuration_auto
    except Exception as exc:
        _fail("doctor", f"cannot import transformers ({type(exc).__name__}: {exc})", code=1)
    module_names = _doctor_module_names(args, configuration_auto, _canonical)

    import importlib

    import transformers

    from autopatch import report, runtime
    from autopatch.session import Session

    session = Session(settings)  # doctor's own: the rules record here, nothing is said or judged
    kernels_shown = sorted(settings.kernels(), key=KERNEL_NAMES.index) if configured else list(KERNEL_NAMES)
    print(f"autopatch doctor: transformers {transformers.__version__}; kernels: "
          + (", ".join(kernels_shown) or "none")
          + ("" if configured else " (nothing configured: showing every kernel)"))
    if settings.models:
        print("per-model overrides: " + "; ".join(
            f"{t}: " + ", ".join(f"{k}={'on' if v else 'off'}" for k, v in ks.items()) for t, ks in settings.models.items()))
    print()
    failures = 0
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            print(f"{name}\n  could not import: {type(exc).__name__}: {exc}\n")
            failures += 1
            continue
        types = runtime.model_types_of(module)

        def enabled(kernel, _types=types):
            return settings.enabled_for(kernel, _types) if configured else True

        try:
            found = runtime.run_rules(module, session, enabled)
        except Exception as exc:
            print(f"{name}\n  the rules failed: {type(exc).__name__}: {exc}\n")
            failures += 1
            continue
        off = [k for k in KERNEL_NAMES if not enabled(k)]
        header = f"{name}  (model_type {', '.join(types)})"
        if found:
            print(header)
            print(report.format_table(found).split("\n", 1)[1].rstrip("\n"))
        else:
            print(header + "\n  no component matched any enabled rule")
        if off:
            print(f"  off: {', '.join(off)}")
        print()
    return 1 if failures and failures == len(module_names) else 0


def _doctor_module_names(args, configuration_auto, canonical) -> list[str]:
    from autopatch import hooks

    if args.all:
        return hooks.modeling_module_names()
    known = {canonical(t): t for t in configuration_auto.CONFIG_MAPPING_NAMES}
    wanted = args.model_types or list(DOCTOR_DEFAULT_MODEL_TYPES)
    names: list[str] = []
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    models_dir = os.path.join(list(spec.submodule_search_locations)[0], "models")
    for model_type in wanted:
        real = known.get(canonical(model_type))
        if real is None:
            import difflib

            close = difflib.get_close_matches(canonical(model_type), list(known), n=3)
            hint = f"did you mean {' or '.join(known[c] for c in close)}? " if close else ""
            _fail("doctor", f"unknown model type {model_type!r}; {hint}valid: the model_type of a transformers "
                  f"config ({len(known)} known)")
        folder = configuration_auto.model_type_to_module_name(real)
        path = os.path.join(models_dir, folder)
        if not os.path.isdir(path):
            path = os.path.join(models_dir, "deprecated", folder)
            prefix = f"transformers.models.deprecated.{folder}"
        else:
            prefix = f"transformers.models.{folder}"
        try:
            files = sorted(os.listdir(path))
        except OSError:
            files = []
        found = [f"{prefix}.{f[:-3]}" for f in files if f.startswith("modeling_") and f.endswith(".py")
                 and not f.startswith(("modeling_tf_", "modeling_flax_"))]
        if not found:
            print(f"autopatch doctor: {real}: no modeling module in transformers ({path})", file=sys.stderr)
        names += [n for n in found if n not in names]
    return names


if __name__ == "__main__":
    sys.exit(main())
