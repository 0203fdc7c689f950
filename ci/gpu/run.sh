#!/usr/bin/env bash
# Runs on the GPU machine from the repository root:
#   bash gpu-bundle/run.sh [all|info|conformance|behaviour|tests|serve|simulate|bench|two-gpu]
# (`two-gpu` is not part of `all`: it needs the two-GPU machine kind).
# Writes every result under $OUT (or gpu-out/ when OUT is unset).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
log="$out/gpu-run.log"
exec > >(tee "$log") 2>&1
only="${1:-all}"

# One line per `kvvm behaviour --json` report: counts, fault runs, driver free memory, failures.
summarize_behaviour() {
  python3 - "$1" <<'PY' || true
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
bad = [(c["name"], c["reason"]) for c in r["cases"] if c["status"] != "pass"]
print(sys.argv[1].rsplit("/", 1)[-1], r["backend"], r["device"], f"{r['passed']} passed, {r['failed']} failed,",
      f"{r['fault_runs']} fault runs, {r['faults_fired']} faults,",
      f"driver free {r['driver_free_before']} -> {r['driver_free_after']}", bad[:3])
PY
}

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

if [ "$only" = all ] || [ "$only" = behaviour ]; then
  echo "== behaviour suite with every single and double fault: cuda, hip through the shim"
  free_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1; }
  echo "GPU memory used before: $(free_mib) MiB"
  "$here/kvvm" behaviour --backend cuda --json > "$out/behaviour-cuda.json"; echo "cuda exit $?"
  KVVM_HIP_LIBRARY="$here/libhip_on_cuda.so" "$here/kvvm" behaviour --backend hip --json \
    > "$out/behaviour-hip-shim.json"; echo "hip exit $?"
  echo "GPU memory used after: $(free_mib) MiB"
  if command -v compute-sanitizer > /dev/null; then
    echo "== the same cuda run under compute-sanitizer --tool memcheck"
    compute-sanitizer --tool memcheck --show-backtrace no --print-limit 20 \
      --log-file "$out/memcheck.txt" \
      "$here/kvvm" behaviour --backend cuda --json > "$out/behaviour-cuda-memcheck.json"
    echo "memcheck exit $?"
    tail -n 5 "$out/memcheck.txt"
    echo "API errors reported: $(grep -c 'Program hit' "$out/memcheck.txt")"
  fi
  for f in behaviour-cuda behaviour-hip-shim behaviour-cuda-memcheck; do
    summarize_behaviour "$out/$f.json"
  done
fi

if [ "$only" = all ] || [ "$only" = bench ]; then
  if "$here/kvvm" help 2>/dev/null | grep -q '^  bench'; then
    echo "== benches"
    "$here/kvvm" bench vmm --backend cuda --json > "$out/bench-vmm.json" || echo "bench vmm failed"
    "$here/kvvm" bench decode --backend cuda --json > "$out/bench-decode.json" || echo "bench decode failed"
    "$here/kvvm" bench kv --backend cuda --json > "$out/bench-kv.json" || echo "bench kv failed"
  fi
fi
if [ "$only" = two-gpu ]; then
  # Every device and the peer links: conformance and the behaviour suite on each device, for
  # CUDA and for HIP through the shim, each device's memory before and after, and the
  # tensor-parallel commit over all devices.
  n=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
  echo "== $n GPUs; the driver's topology"
  nvidia-smi topo -m || true
  "$here/kvvm" info
  "$here/kvvm" info --json > "$out/info.json"
  used() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' '; }
  shim=(env KVVM_HIP_LIBRARY="$here/libhip_on_cuda.so")
  for d in $(seq 0 $((n - 1))); do
    echo "== device $d: conformance cuda, hip (shim)"
    "$here/kvvm" conformance --backend cuda --device "$d"
    "$here/kvvm" conformance --backend cuda --device "$d" --json > "$out/conformance-cuda-dev$d.json"
    "${shim[@]}" "$here/kvvm" conformance --backend hip --device "$d" | tail -n 12
    "${shim[@]}" "$here/kvvm" conformance --backend hip --device "$d" --json > "$out/conformance-hip-shim-dev$d.json"
    echo "== device $d: behaviour with every single and double fault (memory used before: $(used))"
    "$here/kvvm" behaviour --backend cuda --device "$d" --json > "$out/behaviour-cuda-dev$d.json"; echo "cuda exit $?"
    "${shim[@]}" "$here/kvvm" behaviour --backend hip --device "$d" --json > "$out/behaviour-hip-shim-dev$d.json"; echo "hip exit $?"
    echo "memory used after: $(used)"
  done
  for f in "$out"/behaviour-*-dev*.json; do
    summarize_behaviour "$f"
  done
  echo "== bench tp (one transaction on every device vs one commit after the other vs raw)"
  "$here/kvvm" bench tp --backend cuda
  "$here/kvvm" bench tp --backend cuda --json > "$out/bench-tp.json"
fi
echo "== done"
