#!/usr/bin/env bash
# The H200 work of a session in as few device calls as possible (logs under OUT, a short summary last):
#   tests: the GPU tests (numerics, one launch per step, verify, hub load)  -> OUT/pytest-gpu.log   (~2-4 min)
#   smoke: kernel vs CPU reference executor + step latency per preset       -> OUT/smoke-*.json     (~1-3 min)
#   bench: decode benchmark table + chart, one preset per process            -> OUT/bench-<preset>/  (~3.5 min each)
# A device call is limited to 10 minutes: pick parts with PARTS (default "tests smoke"), e.g.
#   source .cute/activate.sh && bash scripts/gpu_session.sh "$OUT" smollm-135m llama-3.2-1b
#   source .cute/activate.sh && PARTS=bench bash scripts/gpu_session.sh "$OUT" llama-3.2-1b
# Each part has its own time limit so one hang cannot eat the whole call.
set -uo pipefail
OUT=${1:?usage: gpu_session.sh OUT [presets...]}
shift
PRESETS=("$@")
((${#PRESETS[@]})) || PRESETS=(smollm-135m llama-3.2-1b)
PARTS=${PARTS:-tests smoke}
mkdir -p "$OUT"
summary=()

if [[ " $PARTS " == *" tests "* ]]; then
  timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ >"$OUT/pytest-gpu.log" 2>&1
  summary+=("pytest -m gpu: rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-gpu.log" | tail -1)")
fi
if [[ " $PARTS " == *" smoke "* ]]; then
  timeout 240 python3 scripts/gpu_smoke.py "${PRESETS[@]}" --out "$OUT" --steps 4 --timeout 110 >"$OUT/smoke.log" 2>&1
  summary+=("smoke: rc=$?" "$(sed -n '/== smoke ==/,$p' "$OUT/smoke.log")")
fi
if [[ " $PARTS " == *" bench "* ]]; then
  for preset in "${PRESETS[@]}"; do
    timeout 280 python3 benchmarks/decode.py --presets "$preset" --out "$OUT/bench-$preset" >"$OUT/bench-$preset.log" 2>&1
    summary+=("bench $preset: rc=$? $(grep -E "^\| $preset" "$OUT/bench-$preset/decode.md" 2>/dev/null)")
  done
fi
printf '%s\n' "${summary[@]}"
