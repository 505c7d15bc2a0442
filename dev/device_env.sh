# Sourced (not run) by the scripts of a device call, from the repository root: installs the carried
# wheels (.whl/: pydantic-settings & co., liger-kernel, cut-cross-entropy) into /tmp/site and puts them
# and the repository on PYTHONPATH (the repository is used in place, not installed); real kernels, not
# the Triton interpreter.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "WARNING: wheel install failed; pydantic-settings / liger / cut-ce may be missing"
else
  echo "WARNING: no .whl/ carried; autopatch needs pydantic-settings, and the Liger / Cut-CE peers will be skipped"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_INTERPRET=0
