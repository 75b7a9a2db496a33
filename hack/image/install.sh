#!/bin/sh
# install.sh WHEELS_DIR: install gpupool into the venv /opt/gpupool, inside the image's root file system
# (run as root in it: chrooted by hack/image/build.py, or a RUN step of the Containerfile). WHEELS_DIR holds
# requirements.lock, every wheel it pins (hack/image/fetch-wheels.sh) and gpupool's own wheel.
# Offline: --no-index, and --require-hashes against the lock. pip is installed from its pinned wheel only
# to install the others, then removed: the image has no pip, setuptools or compiler.
set -eu
wheels="${1:?usage: install.sh WHEELS_DIR}"
venv=/opt/gpupool
python3.11 -m venv --without-pip "$venv"
"$venv/bin/python" "$(ls "$wheels"/pip-*.whl)/pip" install --quiet --no-cache-dir --no-index \
    --find-links "$wheels" --no-deps --require-hashes -r "$wheels/requirements.lock"
# gpupool's own wheel, unless WHEELS_DIR has none: gpupool-ray's cached dependency layer, to which
# install-app.sh adds it
if ls "$wheels"/gpupool-*.whl >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --quiet --no-cache-dir --no-index --no-deps "$wheels"/gpupool-*.whl
fi
"$venv/bin/python" -m pip check
"$venv/bin/python" -m pip uninstall --quiet --yes pip
# what nothing here runs: the venv's activate scripts, numpy's tests, C/Cython sources shipped in wheels,
# the kubernetes client's asyncio copy (kubernetes.aio, 68 MiB; gpupool and kopf use neither)
site="$venv/lib/python3.11/site-packages"
rm -rf "$venv"/bin/activate* "$venv"/bin/Activate.ps1 "$site/kubernetes/aio"
find "$site/numpy" -depth -type d -name tests -exec rm -rf {} +
find "$site" -type f \( -name '*.pyx' -o -name '*.pxd' -o -name '*.c' -o -name '*.h' -o -name '*.cpp' \) -delete
# byte-compile once here (the image runs as a non-root user who cannot write __pycache__ under /opt).
# The kubernetes client's generated API and model classes (~1,500 files, all imported by
# `import kubernetes.client`) keep byte code only, next to where their sources were: -30 MiB
for generated in "$site/kubernetes/client/api" "$site/kubernetes/client/models"; do
    rm -rf "$generated/__pycache__"
    "$venv/bin/python" -m compileall -q -b -j 0 "$generated" >/dev/null
    find "$generated" -name '*.py' -delete
done
"$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null
# every shared library the wheels' extension modules link must be in the image (manylinux wheels expect
# libstdc++ and friends from the system): a missing one fails the build here, not an import at run time
missing="$(find "$venv" -type f -name '*.so*' -exec ldd {} + 2>/dev/null | grep 'not found' | sort -u || true)"
if [ -n "$missing" ]; then
    echo "install.sh: shared libraries the wheels need are not in the image (add their Debian packages to" \
        "hack/image/packages.txt):" >&2
    echo "$missing" >&2
    exit 1
fi
