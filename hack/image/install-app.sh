#!/bin/sh
# install-app.sh WHEELS_DIR: add gpupool's own wheel (in WHEELS_DIR, with pip's pinned wheel) to the venv
# /opt/gpupool that install.sh filled with the lock's dependencies alone: gpupool-ray's last layer, on top of
# its cached dependency layer (hack/image/build.py). Run as root in the image's root file system (chrooted).
# pip runs from its wheel and is not installed; byte code compiled in, as install.sh does.
set -eu
wheels="${1:?usage: install-app.sh WHEELS_DIR}"
venv=/opt/gpupool
pip="$(ls "$wheels"/pip-*.whl)/pip"
"$venv/bin/python" "$pip" install --quiet --no-cache-dir --no-index --no-deps "$wheels"/gpupool-*.whl
"$venv/bin/python" "$pip" check
"$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null
