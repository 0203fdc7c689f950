#!/usr/bin/env bash
# Mutation testing of the governor (kvvm-governor), the manager (kvvm-vmm) and the node's
# broker (kvvm-broker) with cargo-mutants: every mutant of a crate's code must make one of the
# tests below fail. Not run by CI (each crate takes an hour or more on two cores);
# docs/reliability.md, "Mutation testing", records the last figures and every surviving
# mutant judged harmless.
#
#   cargo install cargo-mutants --locked        # once
#   ci/mutants.sh                               # every crate
#   ci/mutants.sh governor                      # one crate: governor, vmm or broker
#   ci/mutants.sh vmm --file crates/vmm/src/device/parking.rs    # one file (more cargo-mutants args)
#
# Which tests judge which crate (what keeps a run tractable):
#   kvvm-governor: the governor's own tests and the manager's (kvvm-vmm), its first user;
#   kvvm-vmm:      the manager's own tests (unit and tests/);
#   kvvm-broker:   the broker's own tests (unit and tests/: processes, restarts, the soak).
# The KV layer, the server and the other crates also exercise both, but building them for each
# mutant would take many hours; what they rely on is asserted by these tests.
#
# Environment: MUTANTS_JOBS (default 1: parallel builds of a mutated tree each take a core),
# MUTANTS_TIMEOUT (seconds a mutant's tests may run, default 30, 120 for the broker; the
# suites take a few seconds (the broker's about 30) on a loaded machine, so a mutant that runs
# this long hangs a test and counts as a timeout),
# MUTANTS_SHARD=k/n (test every n-th mutant from the k-th, counted from 0, round-robin: a
# sample spread over every file; its outcomes go to mutants/<crate>-shard-k-of-n).
#
# After adding tests, `ci/mutants.sh recheck vmm` tests again only the mutants that the crate's
# runs (whole or in shards) missed, into mutants/<crate>-recheck; `ci/mutants.sh summary`
# prints the counts of every run kept under mutants/, and per crate the total with the
# recheck's verdicts and the mutants still missed.
#
# The mutated copies are built in the build's target directory (target/ or CARGO_TARGET_DIR),
# under mutants/build; each crate's outcomes go to mutants/<crate>/mutants.out (outcomes.json,
# caught.txt, missed.txt, timeout.txt, unviable.txt). The script prints, per crate, the counts
# and the share of viable mutants caught (a timeout counts as caught: the mutant hangs a test).
set -euo pipefail
cd "$(dirname "$0")/.."

# Counts per outcome folder (mutants/<name>/mutants.out); per crate, the total over its runs
# (the whole crate or its shards, whichever ran last), with the mutants a recheck caught
# counted as caught.
summary() {
  python3 - "$OUT" <<'PY'
import json
import os
import re
import sys

out = sys.argv[1]
key = {"CaughtMutant": "caught", "MissedMutant": "missed", "Timeout": "timeout", "Unviable": "unviable"}


def names(folder, kind):
    path = os.path.join(folder, f"{kind}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def counts(folder):
    with open(os.path.join(folder, "outcomes.json")) as f:
        data = json.load(f)
    c = {"caught": 0, "missed": 0, "timeout": 0, "unviable": 0}
    for o in data["outcomes"]:
        if o["scenario"] == "Baseline":
            continue
        k = key.get(o["summary"])
        if k is not None:
            c[k] += 1
    c["caught"] += len(names(folder, "previously_caught"))
    return c


def show(name, c):
    viable = c["caught"] + c["missed"] + c["timeout"]
    share = 100.0 * (c["caught"] + c["timeout"]) / viable if viable else 100.0
    print(
        f"{name}: {c['caught']} caught, {c['missed']} missed, {c['unviable']} unviable, "
        f"{c['timeout']} timeout; {share:.1f} % of {viable} viable mutants caught"
    )


for crate in ("governor", "vmm", "broker"):
    runs = sorted(
        d for d in os.listdir(out)
        if re.fullmatch(crate + r"(-shard-[0-9]+-of-[0-9]+)?", d)
        and os.path.exists(os.path.join(out, d, "mutants.out", "outcomes.json"))
    )
    if not runs:
        continue
    # A whole run and shards of another time would count mutants twice: keep the newer kind.
    whole = [d for d in runs if d == crate]
    shards = [d for d in runs if d != crate]
    if whole and shards:
        stamp = lambda d: os.path.getmtime(os.path.join(out, d, "mutants.out", "outcomes.json"))
        runs = whole if stamp(crate) > max(stamp(d) for d in shards) else shards
    total = {"caught": 0, "missed": 0, "timeout": 0, "unviable": 0}
    missed = []
    for d in runs:
        folder = os.path.join(out, d, "mutants.out")
        c = counts(folder)
        show(f"kvvm-{d}", c)
        for k in total:
            total[k] += c[k]
        missed += names(folder, "missed")
    recheck = os.path.join(out, f"{crate}-recheck", "mutants.out")
    if os.path.exists(os.path.join(recheck, "outcomes.json")):
        r = counts(recheck)
        show(f"kvvm-{crate}-recheck", r)
        tested = r["caught"] + r["missed"] + r["timeout"] + r["unviable"]
        total["missed"] -= tested
        for k in total:
            total[k] += r[k]
        missed = names(recheck, "missed")
    show(f"kvvm-{crate} total", total)
    for m in missed:
        print(f"  missed: {m}")
PY
}

run() {
  local c=$1 name=$2
  shift 2
  local pkg="kvvm-$c"
  local tests=(--test-package "$pkg")
  if [ "$c" = governor ]; then
    tests+=(--test-package kvvm-vmm)
  fi
  local timeout=$TIMEOUT
  if [ "$c" = broker ] && [ -z "${MUTANTS_TIMEOUT:-}" ]; then
    timeout=120
  fi
  echo "== cargo mutants on $pkg (tests: ${tests[*]}), outcomes in $OUT/$name"
  local rc=0
  cargo mutants --package "$pkg" "${tests[@]}" --jobs "$JOBS" --jobserver-tasks "$JOBS" \
    --timeout "$timeout" --output "$OUT/$name" --colors never "$@" || rc=$?
  # 0: every mutant caught; 2: some missed; 3: some timed out. Anything else is a failure of
  # the run itself (the baseline failed, bad arguments).
  case $rc in
    0 | 2 | 3) return 0 ;;
    *)
      echo "cargo mutants failed (exit $rc)" >&2
      return "$rc"
      ;;
  esac
}

main() {
  if ! cargo mutants --version >/dev/null 2>&1; then
    echo "cargo-mutants is not installed: cargo install cargo-mutants --locked" >&2
    exit 1
  fi
  TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
    | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
  OUT="$TARGET_DIR/mutants"
  mkdir -p "$OUT"
  # Without this cargo-mutants builds its copy of the tree under the system's temporary
  # folder.
  export CARGO_TARGET_DIR="$OUT/build"
  JOBS=${MUTANTS_JOBS:-1}
  TIMEOUT=${MUTANTS_TIMEOUT:-30}

  local which=${1:-all}
  if [ $# -gt 0 ]; then shift; fi
  case "$which" in
    summary)
      summary
      return
      ;;
    recheck)
      local c=${1:-}
      case "$c" in governor | vmm | broker) shift ;; *)
        echo "usage: ci/mutants.sh recheck governor|vmm|broker [cargo-mutants args...]" >&2
        exit 2
        ;;
      esac
      # Every mutant the crate's runs missed, each named exactly.
      local regex
      regex=$(python3 - "$OUT" "$c" <<'PY'
import glob
import os
import sys

out, crate = sys.argv[1], sys.argv[2]
names = []
for folder in [os.path.join(out, crate)] + sorted(glob.glob(os.path.join(out, crate + "-shard-*"))):
    path = os.path.join(folder, "mutants.out", "missed.txt")
    if os.path.exists(path):
        with open(path) as f:
            names += [line.strip() for line in f if line.strip()]
meta = set("\\.+*?()|[]{}^$")
print("|".join("^" + "".join("\\" + ch if ch in meta else ch for ch in n) + "$" for n in names))
PY
)
      if [ -z "$regex" ]; then
        echo "no missed mutant of kvvm-$c to recheck"
        return
      fi
      run "$c" "$c-recheck" --re "$regex" "$@"
      summary
      return
      ;;
    all) set -- governor vmm broker "$@" ;;
    governor | vmm | broker) set -- "$which" "$@" ;;
    *)
      echo "usage: ci/mutants.sh [all|governor|vmm|broker|recheck CRATE|summary] [cargo-mutants args...]" >&2
      exit 2
      ;;
  esac
  local crates=()
  while [ $# -gt 0 ] && { [ "$1" = governor ] || [ "$1" = vmm ] || [ "$1" = broker ]; }; do
    crates+=("$1")
    shift
  done
  local c name
  for c in "${crates[@]}"; do
    name=$c
    local shard=()
    if [ -n "${MUTANTS_SHARD:-}" ]; then
      name="$c-shard-${MUTANTS_SHARD%/*}-of-${MUTANTS_SHARD#*/}"
      shard=(--shard "$MUTANTS_SHARD" --sharding round-robin)
    fi
    run "$c" "$name" ${shard[@]+"${shard[@]}"} "$@"
  done
  summary
}

main "$@"
