#!/usr/bin/env bash
# The GPU checks in one go, on a lent GPU machine (docs/gpu.md): installs the wheels
# carried in the git-ignored .whl/ folder (nothing can be downloaded there), then runs
# bench/gpu_kit.py, which writes $OUT/results.json (or ./gpu-kit-out/ without $OUT).
#   bash bench/gpu.sh [--budget SECONDS] [--only STEP ...]
set -u
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec python3 bench/gpu_kit.py "$@"
