#!/usr/bin/env bash
# Mutation testing of the governor (kvvm-governor) and the manager (kvvm-vmm) with
# cargo-mutants: every mutant of a crate's code must make one of the tests below fail. Not run
# by CI (the two crates take over an hour on two cores); docs/reliability.md, "Mutation
# testing", records the last figures and every surviving mutant judged harmless.
#
#   cargo install cargo-mutants --locked        # once
#   ci/mutants.sh                               # both crates
#   ci/mutants.sh governor                      # one crate: governor or vmm
#   ci/mutants.sh vmm --file crates/vmm/src/parking.rs    # one file (more cargo-mutants args)
#
# Which tests judge which crate (what keeps a run tractable):
#   kvvm-governor: the governor's own tests and the manager's (kvvm-vmm), its first user;
#   kvvm-vmm:      the manager's own tests (unit and tests/).
# The KV layer, the server and the other crates also exercise both, but building them for each
# mutant would take many hours; what they rely on is asserted by these tests.
#
# Environment: MUTANTS_JOBS (default 1: parallel builds of a mutated tree each take a core),
# MUTANTS_TIMEOUT (seconds a mutant's tests may run, default 60; the suites take about a
# second, so a mutant that runs this long hangs a test and counts as a timeout),
# MUTANTS_SHARD=k/n (test every n-th mutant from the k-th, counted from 0, round-robin: a
# sample spread over every file; its outcomes go to mutants/<crate>-shard-k-of-n).
#
# After adding tests, `ci/mutants.sh vmm --iterate` tests again only the mutants a previous
# run in the same folder did not catch (cargo-mutants keeps the earlier ones in
# previously_caught.txt, which the counts below include). `ci/mutants.sh summary` prints the
# counts of every run kept under mutants/ again, and their total per crate.
#
# The mutated copies are built in the build's target directory (target/ or CARGO_TARGET_DIR),
# under mutants/build; each crate's outcomes go to mutants/<crate>/mutants.out (outcomes.json,
# caught.txt, missed.txt, timeout.txt, unviable.txt). The script prints, per crate, the counts
# and the share of viable mutants caught (a timeout counts as caught: the mutant hangs a test).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo mutants --version >/dev/null 2>&1; then
  echo "cargo-mutants is not installed: cargo install cargo-mutants --locked" >&2
  exit 1
fi

TARGET_DIR=$(cargo metadata --format-version 1 --no-deps \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
OUT="$TARGET_DIR/mutants"
mkdir -p "$OUT"
# Without this cargo-mutants builds its copy of the tree under the system's temporary folder.
export CARGO_TARGET_DIR="$OUT/build"
JOBS=${MUTANTS_JOBS:-1}
TIMEOUT=${MUTANTS_TIMEOUT:-60}

# Counts per outcome folder (mutants/<name>/mutants.out) and, for a crate run in shards, their
# total. A mutant caught by an earlier run that --iterate skipped is counted as caught.
summary() {
  python3 - "$OUT" "$@" <<'PY'
import json
import os
import sys

out, names = sys.argv[1], sys.argv[2:]
key = {"CaughtMutant": "caught", "MissedMutant": "missed", "Timeout": "timeout", "Unviable": "unviable"}
totals = {}


def lines(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def show(name, c):
    viable = c["caught"] + c["missed"] + c["timeout"]
    share = 100.0 * (c["caught"] + c["timeout"]) / viable if viable else 100.0
    print(
        f"{name}: {c['caught']} caught, {c['missed']} missed, {c['unviable']} unviable, "
        f"{c['timeout']} timeout; {share:.1f} % of {viable} viable mutants caught"
    )


for name in names:
    folder = os.path.join(out, name, "mutants.out")
    path = os.path.join(folder, "outcomes.json")
    if not os.path.exists(path):
        continue
    with open(path) as f:
        data = json.load(f)
    c = {"caught": 0, "missed": 0, "timeout": 0, "unviable": 0}
    for o in data["outcomes"]:
        if o["scenario"] == "Baseline":
            continue
        k = key.get(o["summary"])
        if k is not None:
            c[k] += 1
    c["caught"] += lines(os.path.join(folder, "previously_caught.txt"))
    show(f"kvvm-{name}", c)
    crate = name.split("-shard-")[0]
    t = totals.setdefault(crate, {"runs": 0, "caught": 0, "missed": 0, "timeout": 0, "unviable": 0})
    t["runs"] += 1
    for k in c:
        t[k] += c[k]
for crate, t in totals.items():
    if t["runs"] > 1:
        show(f"kvvm-{crate} (all {t['runs']} runs)", t)
PY
}

which=${1:-all}
if [ $# -gt 0 ]; then shift; fi
case "$which" in
  all) crates=(governor vmm) ;;
  governor | vmm) crates=("$which") ;;
  summary)
    summary $(ls "$OUT" | grep -E '^(governor|vmm)(-shard-[0-9]+-of-[0-9]+)?$' | sort)
    exit 0
    ;;
  *)
    echo "usage: ci/mutants.sh [all|governor|vmm|summary] [cargo-mutants args...]" >&2
    exit 2
    ;;
esac

status=0
for c in "${crates[@]}"; do
  pkg="kvvm-$c"
  name=$c
  shard=()
  if [ -n "${MUTANTS_SHARD:-}" ]; then
    name="$c-shard-${MUTANTS_SHARD%/*}-of-${MUTANTS_SHARD#*/}"
    shard=(--shard "$MUTANTS_SHARD" --sharding round-robin)
  fi
  tests=(--test-package "$pkg")
  if [ "$c" = governor ]; then
    tests+=(--test-package kvvm-vmm)
  fi
  echo "== cargo mutants on $pkg (tests: ${tests[*]}), outcomes in $OUT/$name"
  set +e
  cargo mutants --package "$pkg" "${tests[@]}" ${shard[@]+"${shard[@]}"} --jobs "$JOBS" \
    --jobserver-tasks "$JOBS" --timeout "$TIMEOUT" --output "$OUT/$name" --colors never "$@"
  rc=$?
  set -e
  # 0: every mutant caught; 2: some missed; 3: some timed out. Anything else is a failure of
  # the run itself (the baseline failed, bad arguments).
  case $rc in
    0 | 2 | 3) ;;
    *)
      echo "cargo mutants failed (exit $rc)" >&2
      status=$rc
      continue
      ;;
  esac
  summary "$name"
done
exit "$status"
