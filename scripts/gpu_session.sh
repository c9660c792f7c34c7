#!/usr/bin/env bash
# The H200 work of a session in as few device calls as possible (logs under OUT, a short summary last):
#   tests: the GPU tests (numerics, one launch per step, verify, hub load) -> OUT/pytest-gpu.log (~3.5 min), then
#          the bit-identity sweep of tilings -> OUT/pytest-gpu-tilings.log (~2-3 min)
#   smoke: kernel vs CPU reference executor + step latency per preset       -> OUT/smoke-*.json     (~1-3 min)
#   bench: decode benchmark table + chart, all presets in one process          -> OUT/bench/  (~2.5 min per preset;
#          4 presets need two calls: the second with BENCH_RESUME, see below)
#   tune:  GEMV tiling / preload / pipeline sweep with per-stage clocks (scripts/gpu_tune.py) -> OUT/tune-*.json
#          (~2 min per preset for all 17 variants; VARIANTS="default t2u4-pipe ..." picks some)
# A device call is limited to 10 minutes: pick parts with PARTS (default "tests"), e.g.
#   source .cute/activate.sh && bash scripts/gpu_session.sh "$OUT" smollm-135m llama-3.2-1b
#   source .cute/activate.sh && PARTS=bench bash scripts/gpu_session.sh "$OUT" smollm-135m llama-3.2-1b
# Each part has its own time limit so one hang cannot eat the whole call.
set -uo pipefail
OUT=${1:?usage: gpu_session.sh OUT [presets...]}
shift
PRESETS=("$@")
((${#PRESETS[@]})) || PRESETS=(smollm-135m llama-3.2-1b qwen2.5-0.5b qwen3-0.6b)
PARTS=${PARTS:-tests}
mkdir -p "$OUT"
summary=()

if [[ " $PARTS " == *" tests "* ]]; then
  # two runs with their own limits, so the long tiling sweep cannot starve the rest (or the other way round)
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 -k "not tilings" tests/ \
    >"$OUT/pytest-gpu.log" 2>&1
  summary+=("pytest -m gpu (all but tilings): rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-gpu.log" | tail -1)")
  timeout 270 python3 -m pytest -m gpu -q -p no:cacheprovider --durations=5 -k tilings tests/ \
    >"$OUT/pytest-gpu-tilings.log" 2>&1
  summary+=("pytest -m gpu (tilings): rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-gpu-tilings.log" | tail -1)")
fi
if [[ " $PARTS " == *" smoke "* ]]; then
  timeout 240 python3 scripts/gpu_smoke.py "${PRESETS[@]}" --out "$OUT" --steps 4 --timeout 110 >"$OUT/smoke.log" 2>&1
  summary+=("smoke: rc=$?" "$(sed -n '/== smoke ==/,$p' "$OUT/smoke.log")")
fi
if [[ " $PARTS " == *" bench "* ]]; then
  # BENCH_ARGS="--tiling 2x4+preload+ring4 --attention-preload" benches a chosen kernel instead of the default.
  # BENCH_RESUME=DIR (a folder of the repo holding <preset>-report.json files from a run cut short) seeds the
  # run with them and passes --resume, so only the missing presets are measured.
  # The device returns at most 8 files: the run works in a scratch folder and OUT/bench gets the table, chart,
  # results.json, log and one archive of the reports + package archives (tar -xzf it in the repo root).
  work=$(mktemp -d)/bench
  mkdir -p "$work"
  resume=()
  if [[ -n "${BENCH_RESUME:-}" ]]; then
    cp "$BENCH_RESUME"/*-report.json "$work"/ 2>/dev/null
    resume=(--resume)
  fi
  timeout 560 python3 benchmarks/decode.py --presets "${PRESETS[@]}" --out "$work" "${resume[@]}" ${BENCH_ARGS:-} \
    >"$OUT/bench.log" 2>&1
  rc=$?
  mkdir -p "$OUT/bench"
  cp "$work"/decode.md "$work"/decode.png "$work"/results.json "$work"/decode.log "$OUT/bench"/ 2>/dev/null
  (cd "$work" && tar -czf "$OUT/bench/artifacts.tar.gz" --transform 's,^,bench/,' \
    $(ls *-report.json *-package.tar.gz 2>/dev/null))
  summary+=("bench: rc=$rc" "$(cat "$work/decode.md" 2>/dev/null)")
fi
if [[ " $PARTS " == *" tune "* ]]; then
  # VARIANTS="default t2u4-pipe ..." limits the sweep (names: python3 scripts/gpu_tune.py --help)
  timeout 560 python3 scripts/gpu_tune.py "${PRESETS[@]}" --out "$OUT" ${VARIANTS:+--variants $VARIANTS} \
    >"$OUT/tune.log" 2>&1
  summary+=("tune: rc=$?" "$(sed -n '/^== /,$p' "$OUT/tune.log")")
fi
printf '%s\n' "${summary[@]}"
