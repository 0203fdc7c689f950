#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: installs the kvvm wheel carried in
# gpu-bundle/wheels, then `bash gpu-bundle/python.sh [all|tests|kernels|bench]` runs the Python
# tests (CUDA ones included), the attention kernels' benchmark (`python -m kvvm_bench
# kernels`, arguments in KERNELS_ARGS) and the end-to-end decode benchmark (`python -m
# kvvm_bench generate`, arguments in BENCH_ARGS) and, asked by name only, the serving benchmark
# (`bash gpu-bundle/python.sh serve`: `python -m kvvm_bench serve`, arguments in SERVE_ARGS;
# `bash gpu-bundle/python.sh engines`: engine processes under a broker and with fixed
# fractions, `python -m kvvm_bench engines`, arguments in ENGINES_ARGS; `bash gpu-bundle/python.sh
# kvcached`: kvcached 0.1.6 built from the bundle's sdist (gpu-bundle/kvcached-0.1.6.tar.gz), then
# `python -m kvvm_bench kvcached`, kvvm beside it, arguments in KVCACHED_ARGS; `bash
# gpu-bundle/python.sh sliding`: a Gemma-3-shaped model to 32k tokens, KvvmCache against
# DynamicCache, `python -m kvvm_bench sliding`, arguments in SLIDING_ARGS; `bash
# gpu-bundle/python.sh shapes`: the decode kernel and the captured step on every head dim, GQA
# ratio and dtype, `python -m kvvm_bench shapes`, arguments in SHAPES_ARGS; `bash
# gpu-bundle/python.sh http`: a trace through the engine directly and through its OpenAI server,
# `python -m kvvm_bench http`, arguments in HTTP_ARGS; `bash gpu-bundle/python.sh sampling`: the
# engine's step with sampling on against greedy, `python -m kvvm_bench sampling`, SAMPLING_ARGS; `bash
# gpu-bundle/python.sh swap`: the host tier's copy bandwidth, decode while swapping, the
# swap-vs-recompute crossover, a prefix host hit against a prefill (--parts prefix) and a
# memory-pressure trace, `python -m kvvm_bench swap`,
# arguments in SWAP_ARGS; `bash gpu-bundle/python.sh cascade`: the cascade decode over shared
# prefixes against the plain step, `python -m kvvm_bench cascade`, arguments in CASCADE_ARGS; `bash
# gpu-bundle/python.sh fp8`: the captured step with FP8 KV against bf16 KV at 64 x 4096, each over
# its own floor, and their teacher-forced logits compared, `python -m kvvm_bench fp8`, FP8_ARGS; `bash
# gpu-bundle/python.sh products`: a decode step's products, cuBLAS against kvvm's kernel, weight by
# weight, `python -m kvvm_bench products`, PRODUCTS_ARGS).
# KVVM_PY_OVERLAY=1 copies the working tree's Python modules over the installed ones (a change
# to Python code only, measured without rebuilding the wheel). Results under $OUT (or gpu-out/).
set -uo pipefail
# Several modes in one call, comma-separated (`bash gpu-bundle/python.sh fp8,cascade,tests`):
# each run in turn, as if called alone (one machine start for all of them).
if [[ "${1:-}" == *,* ]]; then
  IFS=, read -ra modes <<< "$1"
  for m in "${modes[@]}"; do
    bash "$0" "$m"
    cp "${OUT:-$PWD/gpu-out}/python-run.log" "${OUT:-$PWD/gpu-out}/python-run-$m.log" 2>/dev/null
  done
  exit 0
fi
repo="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
exec > >(tee "$out/python-run.log") 2>&1
site=/tmp/kvvm-site
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" gpu-bundle/wheels/kvvm-*.whl || exit 1
# The OpenAI server's dependencies (ci/gpu/pack.sh downloads them), for `http` and the server's tests.
if ls gpu-bundle/serve-deps/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" gpu-bundle/serve-deps/*.whl \
    || echo "the server's dependencies did not install"
fi
if [ -n "${KVVM_PY_OVERLAY:-}" ]; then
  # Every Python module, subpackages (kvvm/serving) included.
  (cd "$repo/crates/python/python/kvvm" && find . -name '*.py' -exec cp --parents {} "$site/kvvm/" \;) \
    && echo "Python modules overlaid from the working tree"
fi
# The benchmarks run from the checkout (they are not in the wheel).
export PYTHONPATH="$site:$repo/crates/python/benches" PYTHONUNBUFFERED=1
date -u
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import kvvm, torch, transformers, numpy; print('kvvm', kvvm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__, 'from', kvvm.__file__)"
mode="${1:-all}"
if [ "$mode" = all ] || [ "$mode" = tests ]; then
  echo "== pytest (CUDA tests included)"
  (cd /tmp && timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest ${PYTEST_PATHS:-"$repo/crates/python/tests"} -rs -q -p no:cacheprovider ${PYTEST_ARGS:-}) | tee "$out/pytest-gpu.log"
fi
if [ "$mode" = all ] || [ "$mode" = kernels ]; then
  echo "== python -m kvvm_bench kernels"
  (cd /tmp && timeout "${KERNELS_TIMEOUT:-240}" python3 -m kvvm_bench kernels --json "$out/bench-kernels.json" ${KERNELS_ARGS:-}) > "$out/bench-kernels.out"
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  echo "== python -m kvvm_bench generate"
  (cd /tmp && timeout "${BENCH_TIMEOUT:-480}" python3 -m kvvm_bench generate --json "$out/bench-generate.json" ${BENCH_ARGS:-}) > "$out/bench-generate.out"
fi
if [ "$mode" = engines ]; then
  echo "== python -m kvvm_bench engines"
  (cd /tmp && timeout "${ENGINES_TIMEOUT:-540}" python3 -m kvvm_bench engines --kvvm-bin "$repo/gpu-bundle/kvvm" --json "$out/bench-engines.json" ${ENGINES_ARGS:-}) > "$out/bench-engines.out"
fi
if [ "$mode" = kvcached ]; then
  echo "== kvcached 0.1.6 from gpu-bundle/kvcached-0.1.6.tar.gz, then python -m kvvm_bench kvcached"
  kvcached_site=/tmp/kvcached-site
  rm -rf "$kvcached_site" gpu-bundle/kvcached-0.1.6
  tar -xzf gpu-bundle/kvcached-0.1.6.tar.gz -C gpu-bundle
  # Its run-time dependencies (posix_ipc, wrapt), carried as wheels for the machine's Python.
  if ls gpu-bundle/kvcached-deps/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target "$kvcached_site" gpu-bundle/kvcached-deps/*.whl \
      || echo "kvcached's dependencies did not install"
  fi
  # Built against the installed torch; a failed build leaves the directory without kvcached,
  # which the benchmark records (kvcached's side failed, its import error as evidence).
  timeout "${KVCACHED_BUILD_TIMEOUT:-300}" python3 -m pip install --no-index --no-build-isolation --no-deps \
    --target "$kvcached_site" gpu-bundle/kvcached-0.1.6 > "$out/kvcached-build.log" 2>&1 \
    || echo "kvcached did not build: see kvcached-build.log"
  (cd /tmp && timeout "${KVCACHED_TIMEOUT:-420}" python3 -m kvvm_bench kvcached --kvvm-bin "$repo/gpu-bundle/kvvm" \
    --kvcached-dir "$kvcached_site" --kvcached-src "$repo/gpu-bundle/kvcached-0.1.6" \
    --json "$out/bench-kvcached.json" ${KVCACHED_ARGS:-}) > "$out/bench-kvcached.out"
fi
if [ "$mode" = sliding ]; then
  echo "== python -m kvvm_bench sliding"
  (cd /tmp && timeout "${SLIDING_TIMEOUT:-420}" python3 -m kvvm_bench sliding --json "$out/bench-sliding.json" ${SLIDING_ARGS:-}) > "$out/bench-sliding.out"
fi
if [ "$mode" = shapes ]; then
  echo "== python -m kvvm_bench shapes"
  (cd /tmp && timeout "${SHAPES_TIMEOUT:-540}" python3 -m kvvm_bench shapes --commit "$(cat "$repo/gpu-bundle/COMMIT" 2>/dev/null)" \
    --json "$out/bench-shapes.json" ${SHAPES_ARGS:-}) > "$out/bench-shapes.out"
fi
if [ "$mode" = http ]; then
  echo "== python -m kvvm_bench http"
  (cd /tmp && timeout "${HTTP_TIMEOUT:-540}" python3 -m kvvm_bench http --json "$out/bench-http.json" ${HTTP_ARGS:-}) > "$out/bench-http.out"
fi
if [ "$mode" = sampling ]; then
  echo "== python -m kvvm_bench sampling"
  (cd /tmp && timeout "${SAMPLING_TIMEOUT:-420}" python3 -m kvvm_bench sampling --json "$out/bench-sampling.json" ${SAMPLING_ARGS:-}) > "$out/bench-sampling.out"
fi
if [ "$mode" = swap ]; then
  echo "== python -m kvvm_bench swap"
  (cd /tmp && timeout "${SWAP_TIMEOUT:-540}" python3 -m kvvm_bench swap --json "$out/bench-swap.json" ${SWAP_ARGS:-}) > "$out/bench-swap.out"
fi
if [ "$mode" = cascade ]; then
  echo "== python -m kvvm_bench cascade"
  (cd /tmp && timeout "${CASCADE_TIMEOUT:-420}" python3 -m kvvm_bench cascade --json "$out/bench-cascade.json" ${CASCADE_ARGS:-}) > "$out/bench-cascade.out"
fi
if [ "$mode" = fp8 ]; then
  echo "== python -m kvvm_bench fp8"
  (cd /tmp && timeout "${FP8_TIMEOUT:-420}" python3 -m kvvm_bench fp8 --json "$out/bench-fp8.json" ${FP8_ARGS:-}) > "$out/bench-fp8.out"
fi
if [ "$mode" = products ]; then
  echo "== python -m kvvm_bench products"
  (cd /tmp && timeout "${PRODUCTS_TIMEOUT:-300}" python3 -m kvvm_bench products --json "$out/bench-products.json" ${PRODUCTS_ARGS:-}) > "$out/bench-products.out"
fi
if [ "$mode" = serve ]; then
  echo "== python -m kvvm_bench serve"
  (cd /tmp && timeout "${SERVE_TIMEOUT:-480}" python3 -m kvvm_bench serve --json "$out/bench-serve.json" ${SERVE_ARGS:-}) > "$out/bench-serve.out"
fi
echo "== done"
