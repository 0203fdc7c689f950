#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: bash gpu-bundle/run.sh [all|info|conformance|tests|serve|simulate|bench]
# Writes every result under $OUT (or gpu-out/ when OUT is unset).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
log="$out/gpu-run.log"
exec > >(tee "$log") 2>&1
only="${1:-all}"

echo "== machine"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
echo "bundle commit: $(cat "$here/COMMIT" 2>/dev/null)"

if [ "$only" = all ] || [ "$only" = info ]; then
  echo "== kvvm info"
  "$here/kvvm" info
  "$here/kvvm" info --json > "$out/info.json"
fi

if [ "$only" = all ] || [ "$only" = conformance ]; then
  echo "== conformance: cuda"
  "$here/kvvm" conformance --backend cuda
  "$here/kvvm" conformance --backend cuda --json > "$out/conformance-cuda.json"
  echo "== conformance: hip through the HIP-on-CUDA shim"
  KVVM_HIP_LIBRARY="$here/libhip_on_cuda.so" "$here/kvvm" info --backend hip
  KVVM_HIP_LIBRARY="$here/libhip_on_cuda.so" "$here/kvvm" conformance --backend hip
  KVVM_HIP_LIBRARY="$here/libhip_on_cuda.so" "$here/kvvm" conformance --backend hip --json > "$out/conformance-hip-shim.json"
fi

if [ "$only" = all ] || [ "$only" = tests ]; then
  echo "== test binaries"
  fails=0
  for t in "$here"/tests/*; do
    echo "-- $(basename "$t")"
    if ! KVVM_HIP_SHIM="$here/libhip_on_cuda.so" timeout 300 "$t" --test-threads=1 --nocapture 2>&1 | tail -n 40; then
      fails=$((fails + 1))
    fi
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: $(basename "$t")"; fails=$((fails + 1)); }
  done
  echo "test binaries with failures: $fails"
fi

if [ "$only" = all ] || [ "$only" = serve ]; then
  echo "== kvvm serve smoke test on CUDA"
  bash "$here/smoke-serve.sh"
fi

if [ "$only" = all ] || [ "$only" = simulate ]; then
  echo "== kvvm simulate on CUDA"
  "$here/kvvm" simulate --backend cuda --plot "$out/simulate-cuda.svg"
fi

if [ "$only" = all ] || [ "$only" = bench ]; then
  if "$here/kvvm" help 2>/dev/null | grep -q '^  bench'; then
    echo "== benches"
    "$here/kvvm" bench vmm --backend cuda --json > "$out/bench-vmm.json" || echo "bench vmm failed"
    "$here/kvvm" bench decode --backend cuda --json > "$out/bench-decode.json" || echo "bench decode failed"
    "$here/kvvm" bench kv --backend cuda --json > "$out/bench-kv.json" || echo "bench kv failed"
  fi
fi
echo "== done"
