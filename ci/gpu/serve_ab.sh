#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: the serving benchmark's engine on workload A
# (64 requests at once, prompts 128..2048, 128 new tokens) and workload B (64 requests sharing a
# 2048-token system prompt, 128 private tokens each, 128 new), for two builds in one call, rounds
# alternating (base, new, base, new, ...) so that both see the same machine:
#
#   base: gpu-bundle/ab-base/wheels/kvvm-*.whl with its benchmarks gpu-bundle/ab-base/benches
#   new:  gpu-bundle/wheels/kvvm-*.whl with this checkout's crates/python/benches
#
# Pack here: `bash ci/gpu/pack.sh` (the new wheel), then the base wheel and benchmarks from the
# other commit's checkout: `python3 -m pip wheel --no-deps -w gpu-bundle/ab-base/wheels BASE` and
# `cp -r BASE/crates/python/benches gpu-bundle/ab-base/benches`. ROUNDS (default 2) rounds of
# WORKLOADS (default "A B"; one a call keeps a call under 10 minutes); AB_ARGS go to every run. Prints one line a run and the median tokens/s of each build and
# workload; reports under $OUT (or gpu-out/).
set -uo pipefail
repo="$PWD"
out="${OUT:-$PWD/gpu-out}"
mkdir -p "$out"
exec > >(tee "$out/serve-ab.log") 2>&1
for build in base new; do
  rm -rf "/tmp/kvvm-ab-$build"
  wheels=gpu-bundle/wheels
  [ "$build" = base ] && wheels=gpu-bundle/ab-base/wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/kvvm-ab-$build" "$wheels"/kvvm-*.whl || exit 1
done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
declare -A workload=(
  [A]="--requests 64 --prompt-lo 128 --prompt-hi 2048 --output 128"
  [B]="--requests 64 --prompt-lo 128 --prompt-hi 128 --shared-prefix 2048 --output 128"
)
# AB_STEPS=1 times the engine's steps (prefill and decode-only: ci/gpu/serve_steps.py, which
# works with both builds); AB_PROFILE=1 also profiles them (kernels and host operators).
# AB_REPEAT=N runs each build's benchmark N times in one process (a report each; the medians
# take them all).
serve="-m kvvm_bench serve"
[ -n "${AB_STEPS:-}${AB_PROFILE:-}${AB_REPEAT:-}" ] \
  && serve="$repo/ci/gpu/serve_steps.py ${AB_PROFILE:+--profile} ${AB_REPEAT:+--repeat $AB_REPEAT} --"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for w in ${WORKLOADS:-A B}; do
    for build in base new; do
      benches="$repo/crates/python/benches"
      [ "$build" = base ] && benches="$repo/gpu-bundle/ab-base/benches"
      json="$out/serve-ab-$w-$build-$round.json"
      # shellcheck disable=SC2086
      (cd /tmp && PYTHONPATH="/tmp/kvvm-ab-$build:$benches" timeout "${AB_TIMEOUT:-400}" python3 $serve \
        --runners kvvm-engine --fuse-projections ${workload[$w]} ${AB_ARGS:-} --json "$json") > "$json.out" 2>&1
      python3 -c "
import glob, json, sys
for path in [sys.argv[1], *sorted(glob.glob(sys.argv[1][:-5] + '-r*.json'))]:
    r = json.load(open(path))['results'][0]
    print('$w $build round $round', path[len(sys.argv[1]) - 5:-5] or '', ':', r['tokens_per_s'], 'tokens/s, TTFT p50',
          r['ttft_ms'].get('p50'), 'ms, ITL p50/p99', r['itl_ms'].get('p50'), r['itl_ms'].get('p99'), 'ms, wall',
          r['wall_s'], 's')" "$json" \
        || { echo "$w $build round $round failed:"; tail -n 20 "$json.out"; }
      grep -h "^steps " "$json.out" || true
      [ -n "${AB_PROFILE:-}" ] && { echo "profile, $w $build round $round:"; grep -v "^steps " "$json.out" | grep -A40 "Name"; }
    done
  done
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
for w in "AB":
    if not glob.glob(f"{sys.argv[1]}/serve-ab-{w}-*.json"):
        continue
    med = {}
    for build in ("base", "new"):
        runs = [json.load(open(p))["results"][0]["tokens_per_s"] for p in sorted(glob.glob(f"{sys.argv[1]}/serve-ab-{w}-{build}-*.json"))]
        med[build] = statistics.median(runs) if runs else float("nan")
        print(f"workload {w} {build}: {runs} tokens/s, median {med[build]}")
    print(f"workload {w}: new / base = {med['new'] / med['base']:.4f}")
PY
