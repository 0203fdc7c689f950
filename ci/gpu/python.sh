#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: installs the kvvm wheel carried in
# gpu-bundle/wheels, runs the Python tests (CUDA ones included) and the end-to-end benchmark
# (`python -m kvvm.bench generate`). Results under $OUT (or gpu-out/).
set -uo pipefail
repo="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
exec > >(tee "$out/python-run.log") 2>&1
site=/tmp/kvvm-site
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" gpu-bundle/wheels/kvvm-*.whl || exit 1
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import kvvm, torch, transformers, numpy; print('kvvm', kvvm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__, 'from', kvvm.__file__)"
if [ "${1:-all}" != bench ]; then
  echo "== pytest (CUDA tests included)"
  (cd /tmp && timeout 300 python3 -m pytest "$repo/crates/python/tests" -rs -q -p no:cacheprovider) | tee "$out/pytest-gpu.log"
fi
if [ "${1:-all}" != tests ]; then
  echo "== python -m kvvm.bench generate"
  (cd /tmp && timeout "${BENCH_TIMEOUT:-480}" python3 -m kvvm.bench generate --backend cuda --json "$out/bench-generate.json" ${BENCH_ARGS:-}) | tee "$out/bench-generate.md"
fi
echo "== done"
