#!/usr/bin/env bash
# Builds, here, the release binaries the GPU machine needs (it has CUDA but no Rust toolchain)
# and packs them with ci/gpu/run.sh into gpu-bundle/ (git-ignored). One device call then
# carries that folder and runs everything:
#
#   bash ci/gpu/pack.sh                      # here
#   device run, carry ["gpu-bundle"]:  bash gpu-bundle/run.sh      # there; results in $OUT
#
# See docs/gpu-testing.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=gpu-bundle
rm -rf "$bundle"
mkdir -p "$bundle/tests"

# Test binaries of the crates that touch a real driver or produce GPU figures.
crates=(-p kvvm -p kvvm-cuda -p kvvm-hip -p kvvm-conformance)
for extra in kvvm-vmm kvvm-kv; do
  if cargo metadata --no-deps --format-version 1 | grep -q "\"name\":\"$extra\""; then
    crates+=(-p "$extra")
  fi
done
cargo test --release --no-run "${crates[@]}" --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil, os
skip = {"fake_driver", "ptx", "sim_suite", "sim_behaviour", "proptest_model", "state_machine", "stress", "fault_injection"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m.get("profile", {}).get("test"):
        continue
    t = m["target"]
    if t["name"] in skip:
        continue
    pkg = os.path.basename(os.path.dirname(m["manifest_path"]))
    name = pkg + "--" + t["kind"][0] + "--" + t["name"]
    shutil.copy(m["executable"], os.path.join("gpu-bundle/tests", name))
    print("packed test", name)
'

# The CLI, the HIP-on-CUDA shim, and bench binaries where they exist.
cargo build --release -p kvvm-cli -p kvvm-hip-on-cuda
cp target/release/kvvm "$bundle/"
cp target/release/libhip_on_cuda.so "$bundle/"
cp ci/gpu/run.sh ci/gpu/smoke-serve.sh "$bundle/"
# The Python wheel (abi3: built for 3.11 here, it loads into the GPU machine's 3.12).
python3 -m pip wheel -q --no-deps -w "$bundle/wheels" .
# The OpenAI server's and the HTTP benchmark's pure-Python dependencies, as wheels for the GPU
# machine's Python 3.12 (it has no network): ci/gpu/python.sh installs them beside the wheel.
python3 -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 -d "$bundle/serve-deps" \
  starlette==1.10.0 uvicorn==0.55.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 click==8.5.1 \
  httpx==0.29.0 httpcore==1.0.9 certifi==2026.10.19.post1 idna==3.21 typing_extensions==4.16.0
strip "$bundle"/kvvm "$bundle"/tests/* 2>/dev/null || true
git rev-parse --short HEAD > "$bundle/COMMIT" 2>/dev/null || true
du -sh "$bundle"
ls -la "$bundle" "$bundle/tests"
