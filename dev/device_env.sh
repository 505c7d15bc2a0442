# Sourced (not run) by the scripts of a device call, from the repository root: installs the carried
# wheels (.whl/, filled by dev/device_wheels.sh: pydantic-settings & co., liger-kernel, cut-cross-entropy,
# TRL, DeepSpeed) into /tmp/site and puts them and the repository on PYTHONPATH (the repository is used
# in place, not installed); real kernels, not the Triton interpreter.
# A carried autopatch wheel (built here: pip wheel --no-deps . -w .whl/) goes into the image's own
# site-packages, where its autopatch.pth runs at interpreter start: FUSED_KERNELS=all then patches with
# nothing imported, as for a user. The checkout stays first on PYTHONPATH, so the code is this commit's.
if compgen -G ".whl/*.whl" >/dev/null; then
  deps=$(ls .whl/*.whl | grep -v '/autopatch-')
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $deps \
    || echo "WARNING: wheel install failed; pydantic-settings / liger / cut-ce may be missing"
  if compgen -G ".whl/autopatch-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --force-reinstall .whl/autopatch-*.whl \
      || echo "WARNING: the autopatch wheel did not install; its .pth will not run"
  fi
  if [ "${HUB_STACK:-0}" = 1 ]; then  # transformers 5.25 + Hub kernels 0.19.1 over the image's transformers
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/hub/*.whl \
      || echo "WARNING: the HUB_STACK wheels did not install"
  fi
else
  echo "WARNING: no .whl/ carried; autopatch needs pydantic-settings, and the Liger / Cut-CE peers will be skipped"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_INTERPRET=0
