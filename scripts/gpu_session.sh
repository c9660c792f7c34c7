#!/usr/bin/env bash
# The H200 work of a session in as few device calls as possible (logs under OUT, a short summary last):
#   tests: the GPU tests in three runs (each fits one 10-minute device call; pick one with PARTS=tests1 ...):
#          tests1 numerics + one launch per step per preset -> OUT/pytest-gpu-numerics.log (~7 min)
#          tests2 the other kernel tests of test_gpu_decode   -> OUT/pytest-gpu-kernels.log  (~5 min)
#          tests3 tilings, hub, precompiled kernel, verify   -> OUT/pytest-gpu-rest.log     (~4.5 min)
#          (the real-weights tests need the GGUF on the device: README "Running the GPU tests")
#   smoke: kernel vs CPU reference executor + step latency per preset       -> OUT/smoke-*.json     (~1-3 min)
#   mma: the tensor-core GEMV tests (-k mma_gemv: "-k mma" also matches every gemma test) -> OUT/pytest-gpu-mma.log
#   candidates: the GPU tests of the K/V prefetch and split-KV merge builds, then the default build against the
#          remaining candidate, the K/V prefetch into L1 (generate(plan, kv_prefetch_l1=True)), at position 2
#          -> OUT/pytest-gpu-candidates.log, OUT/tune-*-p2.log, OUT/p2/ (~5 min)
#   candidates-long: the default build against that and each split-KV merge alone (gpu_tune builds merge-preload,
#          spread-merge) at position 2000 (SmolLM) / 4000 (Llama-1B, gemma-2b) -> OUT/tune-*-p{2000,4000}.log,
#          OUT/p{2000,4000}/ (5 min, session 17)
#   slices: the default build (split-KV head slices) against head_slices=False at position 16 (gemma-2b,
#          SmolLM, Llama-1B) -> OUT/tune-*-p16.log, OUT/p16/ (~5 min, session 18)
#   long-slices: the default build (head slices at long contexts too) against long_slices=False at 2000 (SmolLM) /
#          4000 (gemma-2b, Qwen2.5-0.5B) -> OUT/tune-*-p*.log, OUT/p*/ (~5 min, session 19)
#   pass-chunks: the GPU test of split-KV chunks in whole CTA passes (a candidate), then the default build against
#          it at 2000 (SmolLM) / 4000 (Qwen2.5-0.5B) -> OUT/pytest-gpu-pass-chunks.log, OUT/tune-*-p*.log (~5 min?)
#   kv-pipeline: the GPU test of split-KV K/V loads one iteration ahead (a candidate), then the default build
#          against it at 4000 (OLMo-2-1B, Llama-1B) / 2000 (SmolLM) -> OUT/pytest-gpu-kv-pipeline.log, OUT/tune-* (~6 min?)
#   long-candidates: both candidates' timings without their GPU tests (tests-parallel has them), one build per
#          preset: kv-pipeline at 4000 (OLMo-2-1B, Llama-1B), kv-pipeline and pass-chunks at 2000 (SmolLM) / 4000
#          (Qwen2.5-0.5B) -> OUT/tune-*-p*.log, OUT/p*/ (~6 min?)
#   fold-merge: its GPU test, then the default build (the split-KV merge folded into the O projection's staging
#          since session 24) against the unfolded one at 2027 (SmolLM-1.7B) / 4000 (OLMo-2-1B, Phi-3-mini) / 2000
#          (SmolLM-135M) -> OUT/pytest-gpu-fold-merge.log, OUT/tune-*-p*.log (6.7 min in session 23)
#   prefetch-followup: with session 26's default (no L2 weight prefetch before ring-filled GEMVs), the K/V
#          prefetch before attention against none at 4000 (Phi-3-mini, OLMo-2-1B), a 5-stage ring fill on
#          Llama-1B at 16, and the batch-8 tensor-core default's 16 MB weight prefetch against none
#          -> OUT/tune-*.log, OUT/p*/, OUT/b8/ (~6 min?, not run yet)
#   split-barrier: the split grid barrier (the default since session 27) against barrier="atom": its GPU test, then
#          Phi-3-mini / OLMo-2 at 4000 and Llama-1B / SmolLM at 16 -> OUT/tune-*-split-*.log (397 s in session 27)
#   split-followup: on the split default, the L2 weight prefetch budgets and the K/V prefetch again (Llama-1B @16,
#          Phi-3-mini @4000; the K/V prefetch on Qwen3-0.6B @4000 too), SmolLM-135M @2000 (growth) and its per-CTA
#          clocks @16 -> OUT/tune-*.log (~7 min?)
#   batch-growth: batch 8's per-stage clocks (gpu_tune --phases) at 16 and at the long end on SmolLM-135M (2027) and
#          Qwen2.5-0.5B (4000), and there the kv-pipeline / no-kvpf / pass-chunks builds (session 30: batch 4/8
#          grow 3-7% past issue 12's budget) -> OUT/tune-*-b8-p*.log, OUT/b8-p*/ (323 s, session 32)
#   mma-attention: the GPU tests of split-KV items of 2-8 query heads on the tensor cores (session 32; the default
#          since 33), then the default against the lane-group loop (lane-attention, the default before) and against
#          the dealing made for it (mma-schedule) at batch 8 (Qwen2.5-0.5B @4000, SmolLM-135M @2027, Llama-1B @4000)
#          -> OUT/pytest-gpu-mma-attention.log, OUT/tune-*-mma-*.log (489 s in session 33); mma-attention-b1: the
#          same timings at batch 1 (Qwen2.5-0.5B @4000 and @16, Qwen3-0.6B @4000), in a call of its own (247 s)
#   fused-o: attention and the O projection in one interval at short contexts (session 34, generate(plan,
#          fused_o=True)): its GPU tests, then GPU ms at 16 on SmolLM-135M against the default, fused-o-lane (the
#          groups on the fp32 lane loop), fused-o-kv (+ K/V rows in shared memory) and kvpf-l1; fused-o-more:
#          Qwen3-0.6B and Qwen2.5-0.5B at 16 and Qwen3-0.6B at 1000; fused-o-llama: Llama-3.2-1B at 16;
#          fused-o-times: fused-o's SmolLM-135M timings without its GPU tests (tests-parallel runs them)
#          -> OUT/pytest-gpu-fused-o.log, OUT/tune-*-fused-o-*.log (session 35: 135 s for fused-o-times and
#          fused-o-llama, 176 s for fused-o-more)
#   balance: the bake's tiling with rows per tile balanced per stage (gpu_tune variant bake-balanced) against the
#          bake's own on Qwen3-0.6B @16, Phi-3-mini @1000, SmolLM-135M @16 -> OUT/tune-*-balance-*.log (301 s in
#          session 31, which balanced the plain tiling by mistake; session 32 on the bake's tiling: the bake wins, 3-10%)
#   host-gap: the benchmark's synchronized-call gap taken apart (gpu_host_cost.py --bench-like: JIT decoder ->
#          package -> next to a graphed baseline -> after torch.profiler) on SmolLM-135M (c2048) and
#          Llama-3.2-1B (c4096) -> OUT/host-gap-*.log, OUT/host-gap-*/host-gap.json (237 s, session 32)
#   kvpf-cap: session 29's K/V prefetch capped at MIN_CHUNK rows per CTA (the default now): its GPU test, then the
#          default against none and the uncapped prefetch (sessions 16-28) at 4000 (Phi-3-mini, Qwen3-0.6B), 1000
#          (Llama-1B) and 16 (SmolLM-135M) -> OUT/pytest-gpu-kvpf-cap.log, OUT/tune-*.log (~5 min?)
#   per-cta: every CTA's phase clocks (timeline="phases-per-cta"): its GPU test, then the barrier waits' sources
#          on Phi-3-mini at 4000 and Llama-1B at 16 (PER_CTA_CASES="preset capacity position;..." for others)
#          -> OUT/pytest-gpu-per-cta.log, OUT/tune-*-per-cta-*.log (151 s in session 27)
#   hang-probe: the tensor-core cases' steps with the barrier watchdog (scripts/gpu_hang_probe.py; a tool for
#          chasing a kernel that never reaches a grid barrier)                   -> OUT/hang-probe.json (~3 min)
#   bench: decode benchmark table + chart, all presets in one process          -> OUT/bench/  (~2.5 min per preset;
#          4 presets need two calls: the second with BENCH_RESUME, see below)
#   tune:  GEMV tiling / preload / pipeline sweep with per-stage clocks (scripts/gpu_tune.py) -> OUT/tune-*.json
#          (~2 min per preset for all 17 variants; VARIANTS="default t2u4-pipe ..." picks some)
#   global-down: the GPU tests of Plan.down_input="global" (session 40; passed on an H100 in session 41: batch 8 of gemma-2b and
#          Mistral-7B, the down GEMV reading its bf16 input rows from global memory; TEST_LIMIT default 240 here),
#          then gpu_tune's bake against bake-global-down at batch 8 (Qwen2.5-0.5B at 16, per-phase clocks)
#          -> OUT/pytest-gpu-global-down.log, OUT/tune-global-down-b8.log (210 s on an H100, session 41)
#   mma-wide: the GPU tests of generate(plan, mma_wide=True) (session 41, not run yet: Gemma's heads of 256 on the
#          tensor cores; TEST_LIMIT default 300 here), then gemma-2b at 4000, batch 8 (MMA_WIDE_BATCHES="8 1": also
#          batch 1), default (lane-group loop) against mma-wide
#          -> OUT/pytest-gpu-mma-wide.log, OUT/tune-mma-wide-b8.log (~8 min?)
#   fused-mlp: the GPU tests of generate(plan, fused_mlp=True) (session 43; 8 passed on an H100: a layer's gate/up
#          and down GEMVs in one interval, int64 fixed-point partial sums), then only if they pass, default against
#          fused-mlp at 16 on SmolLM-135M (FUSED_MLP_SPECS="preset capacity position;..." for others)
#          -> OUT/pytest-gpu-fused-mlp.log, OUT/tune-*-fused-mlp-p*.log (~6 min?)
#   fused-mlp-times: timings without the tests (once they passed), by default Qwen3-0.6B and Qwen2.5-0.5B at 16
#          and SmolLM-135M at 1000 (~5 min?)
#   fused-split: the GPU tests of generate(plan, fused_split=True) (session 44, built without a GPU: every step's
#          O projection in attention's interval, split steps waiting on per-group counters), then only if they pass,
#          default against fused-split and fused-split-mlp at long contexts with the per-stage timeline
#          (FUSED_SPLIT_SPECS="preset capacity position;...", default SmolLM-135M at 2000, Qwen2.5-0.5B at 4000)
#          -> OUT/pytest-gpu-fused-split.log, OUT/tune-*-fused-split-p*.log; fused-split-times: the timings alone
#          (once the tests passed: tests-parallel runs them too)
#   fused-mma-schedule: the GPU test of the fused builds dealt for the tensor cores (generate(plan, fused_o=True,
#          mma_schedule=True), session 45's candidate), then the default against gpu_tune's fused-mma-schedule build
#          (FUSED_MMA_SPECS="preset capacity position;...", default SmolLM-135M at 16/2000, Qwen2.5-0.5B at 16/4000)
#          -> OUT/pytest-gpu-fused-mma-schedule.log, OUT/tune-*-fused-mma-schedule-p*.log; -times: timings alone
#   copy-probe: scripts/gpu_copy_probe.py (each CTA copies 48 / 128 KB into shared memory as the pre-barrier copies
#          do; cp.async 16/4 B against cp.async.bulk; the grid barrier's arrival after or before them, warp 0 copying
#          or not: issue, arrival, release and landing times; PROBE_ARGS replaces the sizes and kinds, e.g.
#          "--kb 48 --kinds none cp16row bulkrow --modes chase split") -> OUT/copy-probe.log, OUT/copy-probe.json
#   stream-probe: scripts/gpu_stream_probe.py (a model's short-context schedule with a loader warp per SM streaming
#          the weights across grid barriers; session 50) on Qwen3-0.6B, Qwen2.5-0.5B, Llama-3.2-1B and SmolLM-135M:
#          today's fill after each barrier (interval) against streaming ahead with 1 / 2 tiles in flight; STREAM_ARGS
#          replaces presets and options -> OUT/stream-probe*.log, OUT/stream-probe*.json (~2 min)
#   tests-parallel: the same tests as tests1-3, the fused_o build's (tests/test_fused_o_gpu.py),
#          tests/test_global_down_gpu.py, tests/test_mma_wide_gpu.py, tests/test_fused_mlp_gpu.py,
#          tests/test_fused_split_gpu.py, tests/test_spare_warp_gpu.py and tests/test_loader_warp_gpu.py (both
#          missing from it until session 52) at once, as
#          SHARDS (default 4) pytest processes on the one GPU
#          (pytest --shard I/N, tests/sharding.py: their CPU-bound setup, random init and CuTe DSL compiles,
#          overlaps; kernels time-share the GPU) -> OUT/pytest-gpu-shard*.log (3 processes: 6.6 min, session 16;
#          8 shards on an H100: 490 s in session 62, and more than 520 s with MEGABAKE_EXPERIMENTAL_LAYOUTS=split_cap
#          in session 63, whose TEST_LIMIT=520 cut 7 shards short: use TEST_LIMIT=570 and a 600 s call; session 65's
#          TEST_LIMIT=565 still left 11 of 151 unreached on an H100). Shard logs are -v: one line per finished test
#   tests-ids: the tests named in TEST_IDS (one node id a line), dealt over SHARDS (default 4) processes: what a
#          tests-parallel call did not reach -> OUT/pytest-gpu-ids*.log
#   loader-flip: the gate for making the loader warp a verified default (session 54). It exports
#          MEGABAKE_EXPERIMENTAL_LAYOUTS=loader_warp (for the parts after it too; redundant since session 55 made it
#          a verified feature), which changes only Qwen3-0.6B and Qwen2.5-0.5B builds at batch 1, and runs every GPU
#          test whose id names them (-k qwen) in 3 shards; then no-loader / the loader default /
#          loader-gate-1-drain-att (the reordered "attention" gate) at 4000 on both
#          -> OUT/pytest-gpu-loader*.log, OUT/tune-qwen*-p4000.log, OUT/p4000/ (328 s on an H100, session 55)
#   loader-check: the GPU tests whose ids name qwen3 (3 shards, ~3 min), on the default session 55 made: the
#          paced loader with the "attention" gate on Qwen3-0.6B at capacity 4096 -> OUT/pytest-gpu-qwen3-*.log
#   att-clocks: where Qwen3-0.6B's long-context step goes (session 56: at 4000 it pays 0.294 ms over its 16-position
#          step for 459 MB of K/V, 1.6 TB/s, against the growth budget's 0.244 ms): gpu_tune of the default at 16 and
#          at 4000 (capacity 4096) with --phases (CTA 0's clock per phase of every stage) and --per-cta (every CTA's,
#          the barrier waits' arrival skew) -> OUT/tune-qwen3-0.6b-p{16,4000}.log, OUT/p{16,4000}/ (136 s on an H100,
#          session 59). ATT_PRESETS="qwen2.5-0.5b" runs it on other presets (capacity 4096 must fit them)
#   kv-fence: the GPU test of session 57's kv_fence candidate (K/V rows of a lane-group iteration issued together,
#          the same bits), then the default against it at 4000 (Qwen2.5-0.5B, Phi-3-mini; FENCE_PHI= skips it) and
#          2000 (SmolLM-135M), where session 19's dealing (short-slices: whole KV groups, now on the tensor cores)
#          is timed too -> OUT/pytest-gpu-kv-fence.log, OUT/tune-*-p*.log (319 s on an H100, session 58)
#   mma-buffers: session 58's mma_two_buffers candidate (tensor-core items' K/V in two buffers, a warp's first two
#          steps in flight together; the same bits): the tensor-core GPU tests (they check its bits), then the
#          default against it where the growth rows that fail run tensor-core items of 64 dims: Qwen2.5-0.5B batch 8
#          @4000, SmolLM-135M batch 8 @2000, Llama-3.2-1B batch 1 @4000 -> OUT/pytest-gpu-mma-buffers.log,
#          OUT/tune-*-b*-p*.log (321 s on an H100, session 59: the same bits, no faster, so not adopted)
#   group-fold: session 59's group_fold (fused_split's O blocks merge up to 16 splits of their group, the items no
#          longer merge first): the default against it on Qwen3-0.6B at 4000 / 1000 and Llama-3.2-1B at 4000 (237 s
#          on an H100, session 59: -2% to -3.4%). Its GPU test (test_group_fold_matches_the_items_merge_to_fp32_order)
#          runs in tests-parallel; with MEGABAKE_EXPERIMENTAL_LAYOUTS=group_fold exported, the whole suite runs on it
#   early-kv: session 59's early_kv candidates (a warp's first tensor-core K/V step issued before its item's query
#          is roped, in split items and fused steps, into registers (early-kv) or as L1 prefetches (early-kv-l1); the
#          same bits): the tensor-core GPU tests (they check both), then the default against them on Llama-3.2-1B b1
#          @16 / @4000 and SmolLM-135M b1 @16 (heads of 64, no loader: no new spills in the local ptxas), and
#          against the L1 one on the loader builds at 16 (Qwen3-0.6B, Qwen2.5-0.5B: early-kv spills there)
#          -> OUT/pytest-gpu-early-kv.log, OUT/tune-*-b*-p*.log (session 60 on an H100: the same bits, no faster;
#          the 600 s limit cut the last spec)
#   split-cap: what the split_cap feature builds (session 62: the tensor-core schedule with fused_o, at most 16
#          splits a KV group; gpu_tune build fused-mma-schedule-cap16): the GPU tests of that build on Qwen2.5-0.5B and
#          SmolLM-135M (build4 / build5, the kernel against its reference executor), then the default against it at
#          4000 / 1000 / 16 (Qwen2.5-0.5B) and 2000 / 1000 / 16 (SmolLM-135M; not in the feature since session 63)
#          -> OUT/pytest-gpu-split-cap.log, OUT/tune-*-p*.log, OUT/tune-json.tar.gz (515 s on an H100, session 63)
#   split-cap-suite: the GPU tests that name qwen2.5-0.5b (the only preset the split_cap feature changes, session
#          63) with MEGABAKE_EXPERIMENTAL_LAYOUTS=split_cap, in 4 processes -> OUT/pytest-gpu-scs*.log,
#          OUT/split-cap-suite-ids.txt (156 s on an H100, session 64: 15 passed; the feature is a default since)
#   items-gate: session 61's loader gate "items" (a split step's gate/up, W_down and next-QKV copies released once
#          the CTA's split-KV items are done, not after its arrival past attention; the same bits): the Qwen3-0.6B
#          and Qwen2.5-0.5B cases of the loader's GPU bit test, then the default against gpu_tune's
#          loader-gate-1-drain-items on Qwen3-0.6B b1 at 4000 / 1000 and Qwen2.5-0.5B b1 at 4000
#          -> OUT/pytest-gpu-items-gate.log, OUT/tune-*-p*.log, OUT/tune-json.tar.gz (not run yet, ~6 min?)
# A device call is limited to 10 minutes: pick parts with PARTS (default "tests1"), e.g.
#   source .cute/activate.sh && PARTS=tests2 bash scripts/gpu_session.sh "$OUT"
#   source .cute/activate.sh && PARTS=bench bash scripts/gpu_session.sh "$OUT" smollm-135m llama-3.2-1b
# Each part has its own time limit so one hang cannot eat the whole call.
set -uo pipefail
OUT=${1:?usage: gpu_session.sh OUT [presets...]}
shift
PRESETS=("$@")
((${#PRESETS[@]})) || PRESETS=(smollm-135m llama-3.2-1b qwen2.5-0.5b qwen3-0.6b)
PARTS=${PARTS:-tests1}
mkdir -p "$OUT"
# preset weights drawn once per warm machine: the folder is git-ignored, so the device keeps it between calls
# (megabake.preset_cache; gemma-2b's draw took 60 s of each call in session 42). Set it empty to turn it off.
export MEGABAKE_PRESET_CACHE=${MEGABAKE_PRESET_CACHE-$PWD/.preset-cache}
summary=()
MMA_SPECS=()  # mma-attention / mma-attention-b1: the (preset batch capacity position) timings to run

[[ " $PARTS " == *" tests "* ]] && PARTS="$PARTS tests1 tests2 tests3"
run_tests() {  # name, -k expression, files...: one pytest run with its own limit; its summary line goes to a file
  local name=$1 select=$2
  shift 2
  # faulthandler_timeout: a test past 150 s dumps every thread's stack into the log (a kernel hang shows as a
  # wait in .cpu() / synchronize)
  local selection=()
  [[ -n "$select" ]] && selection=(-k "$select")
  # PYTEST_VERBOSITY=-v (tests-parallel, tests-ids): one line per finished test with its node id, so a run killed
  # at TEST_LIMIT still shows which tests it reached (-q: progress dots only)
  timeout "${TEST_LIMIT:-580}" python3 -m pytest -m gpu "${PYTEST_VERBOSITY:--q}" -p no:cacheprovider --durations=10 \
    -o faulthandler_timeout=150 \
    "${selection[@]}" "$@" >"$OUT/pytest-gpu-$name.log" 2>&1
  echo "pytest -m gpu ($name): rc=$? $(grep -E '[0-9]+ (passed|failed)' "$OUT/pytest-gpu-$name.log" | tail -1)" \
    >"$OUT/.summary-$name"
}
collect_tests() {  # the summary lines of the pytest runs, in the order they were asked for
  local name
  for name in "$@"; do
    [[ -f "$OUT/.summary-$name" ]] && summary+=("$(cat "$OUT/.summary-$name")") && rm -f "$OUT/.summary-$name"
  done
}
# the three parts of the GPU tests: name, -k expression, files
TESTS1=(numerics "not tilings and (numerics or launch)" tests/test_gpu_decode.py)
TESTS2=(kernels "not tilings and not numerics and not launch" tests/test_gpu_decode.py)
TESTS3=(rest "tilings or hub or precompiled or verify or cold or environment or stand_in or baselines or hand_captured or timing"
        tests/test_gpu_decode.py tests/test_hub_gpu.py tests/test_precompiled_gpu.py tests/test_verify_gpu.py)
if [[ " $PARTS " == *" tests-parallel "* ]]; then
  # SHARDS pytest processes (default 4), each one part of the same selection (tests/sharding.py: tests sharing a
  # module-scoped fixture stay together, parts balanced by the H200's measured test times)
  shards=${SHARDS:-4}
  threads=$(( $(nproc) / shards ))
  ((threads > 0)) || threads=1
  names=()
  for ((i = 0; i < shards; i++)); do
    names+=("shard$i")
    OMP_NUM_THREADS=$threads PYTEST_VERBOSITY=-v run_tests "shard$i" "" --shard "$i/$shards" "${TESTS3[@]:2}" \
      tests/test_fused_o_gpu.py \
      tests/test_global_down_gpu.py tests/test_mma_wide_gpu.py tests/test_fused_mlp_gpu.py \
      tests/test_fused_split_gpu.py tests/test_spare_warp_gpu.py tests/test_loader_warp_gpu.py &
  done
  wait
  collect_tests "${names[@]}"
fi
if [[ " $PARTS " == *" tests-ids "* ]]; then
  # the GPU tests named in TEST_IDS (a file in the tree, one pytest node id a line), dealt round-robin over SHARDS
  # pytest processes (default 4): the rest of a tests-parallel call whose shards hit TEST_LIMIT (session 65 on an
  # H100: 140 of 151 passed in 565 s). Its ids: each shard's `pytest -m gpu --collect-only -q --shard I/N FILES`
  # (run on a CPU, same files) less the PASSED / FAILED lines of its -v log.
  [[ -f "${TEST_IDS:-}" ]] || { echo "tests-ids: TEST_IDS=$TEST_IDS is not a file of node ids" >&2; exit 2; }
  shards=${SHARDS:-4}
  names=()
  for ((i = 0; i < shards; i++)); do
    mapfile -t part < <(awk -v i="$i" -v n="$shards" 'NF && (NR - 1) % n == i' "$TEST_IDS")
    ((${#part[@]})) || continue
    names+=("ids$i")
    OMP_NUM_THREADS=$(( $(nproc) / shards )) PYTEST_VERBOSITY=-v run_tests "ids$i" "" "${part[@]}" &
  done
  wait
  collect_tests "${names[@]}"
fi
if [[ " $PARTS " == *" global-down "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-240} run_tests global-down "" tests/test_global_down_gpu.py
  collect_tests global-down
  # then the A/B where both plans fit: the staging copy the global input skips against its L2 reads (batch 8)
  timeout 300 python3 scripts/gpu_tune.py qwen2.5-0.5b --variants bake bake-global-down --batch 8 \
    --capacity 4096 --no-composite --phases --out "$OUT" >"$OUT/tune-global-down-b8.log" 2>&1
  summary+=("global-down tune: rc=$? $(sed -n '/^== /,$p' "$OUT/tune-global-down-b8.log")")
fi
if [[ " $PARTS " == *" mma-wide "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-300} run_tests mma-wide "" tests/test_mma_wide_gpu.py
  collect_tests mma-wide
  # then gemma-2b's long step with heads of 256 on the tensor cores against the lane-group loop (batch 8; batch 1
  # too with MMA_WIDE_BATCHES="8 1", which may not fit one 10-minute call after the tests)
  for batch in ${MMA_WIDE_BATCHES:-8}; do
    builds="default mma-wide"
    ((batch > 1)) || builds="$builds mma-wide-schedule"  # batch 1 deals one-head slices unless the schedule says
    # shellcheck disable=SC2086
    timeout 200 python3 scripts/gpu_tune.py gemma-2b --variants bake --builds $builds --batch "$batch" \
      --capacity 4096 --position 4000 --no-composite --out "$OUT/b$batch" >"$OUT/tune-mma-wide-b$batch.log" 2>&1
    summary+=("mma-wide tune b$batch: rc=$? $(sed -n '/^== /,$p' "$OUT/tune-mma-wide-b$batch.log")")
  done
fi
if [[ " $PARTS " == *" fused-split "* || " $PARTS " == *" fused-split-times "* ]]; then
  split_rc=0
  if [[ " $PARTS " == *" fused-split "* ]]; then
    TEST_LIMIT=${TEST_LIMIT:-300} run_tests fused-split "" tests/test_fused_split_gpu.py
    split_rc=$(sed -n 's/.*rc=\([0-9]*\).*/\1/p' "$OUT/.summary-fused-split")
    collect_tests fused-split
  fi
  if [[ "$split_rc" == 0 ]]; then  # timings only of a build whose GPU tests passed (here or in an earlier call)
    IFS=';' read -ra split_specs <<<"${FUSED_SPLIT_SPECS:-smollm-135m 2048 2000;qwen2.5-0.5b 4096 4000}"
    for spec in "${split_specs[@]}"; do
      read -r preset capacity position <<<"$spec"
      log="$OUT/tune-$preset-fused-split-p$position.log"
      timeout 200 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default fused-split fused-split-mlp \
        --no-composite --capacity "$capacity" --position "$position" --out "$OUT/fused-split-p$position" >"$log" 2>&1
      summary+=("fused-split tune ($preset at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
    done
  fi
fi
if [[ " $PARTS " == *" fused-mlp "* || " $PARTS " == *" fused-mlp-times "* ]]; then
  mlp_rc=0
  mlp_default="qwen3-0.6b 4096 16;qwen2.5-0.5b 4096 16;smollm-135m 2048 1000"
  if [[ " $PARTS " == *" fused-mlp "* ]]; then
    TEST_LIMIT=${TEST_LIMIT:-330} run_tests fused-mlp "" tests/test_fused_mlp_gpu.py
    mlp_rc=$(sed -n 's/.*rc=\([0-9]*\).*/\1/p' "$OUT/.summary-fused-mlp")
    collect_tests fused-mlp
    mlp_default="smollm-135m 2048 16"
  fi
  if [[ "$mlp_rc" == 0 ]]; then  # timings only of a build whose GPU tests passed (here or in an earlier call)
    IFS=';' read -ra mlp_specs <<<"${FUSED_MLP_SPECS:-$mlp_default}"
    for spec in "${mlp_specs[@]}"; do
      read -r preset capacity position <<<"$spec"
      log="$OUT/tune-$preset-fused-mlp-p$position.log"
      timeout 180 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default fused-o fused-mlp --no-composite \
        --capacity "$capacity" --position "$position" --out "$OUT/fused-mlp-p$position" >"$log" 2>&1
      summary+=("fused-mlp tune ($preset at $position): rc=$?" "$(grep -E '^(==|\|)' "$log")")
    done
  fi
fi
if [[ " $PARTS " == *" fused-mma-schedule "* || " $PARTS " == *" fused-mma-schedule-times "* ]]; then
  mma_rc=0
  if [[ " $PARTS " == *" fused-mma-schedule "* ]]; then
    # the fused builds dealt for the tensor cores (session 45's candidate): kernel vs reference executor first
    TEST_LIMIT=${TEST_LIMIT:-240} run_tests fused-mma-schedule "reference_executor" tests/test_fused_split_gpu.py
    mma_rc=$(sed -n 's/.*rc=\([0-9]*\).*/\1/p' "$OUT/.summary-fused-mma-schedule")
    collect_tests fused-mma-schedule
  fi
  if [[ "$mma_rc" == 0 ]]; then  # timings only of a build whose GPU tests passed
    IFS=';' read -ra mma_specs <<<"${FUSED_MMA_SPECS:-smollm-135m 2048 16;smollm-135m 2048 2000;qwen2.5-0.5b 4096 16;qwen2.5-0.5b 4096 4000}"
    for spec in "${mma_specs[@]}"; do
      read -r preset capacity position <<<"$spec"
      log="$OUT/tune-$preset-fused-mma-schedule-p$position.log"
      timeout 180 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default fused-mma-schedule \
        --no-composite --capacity "$capacity" --position "$position" --out "$OUT/fused-mma-p$position" >"$log" 2>&1
      summary+=("fused-mma-schedule tune ($preset at $position): rc=$?" "$(grep -E '^(==|\|)' "$log")")
    done
  fi
fi
if [[ " $PARTS " == *" copy-probe "* ]]; then
  # what pre-barrier copies into shared memory cost a grid barrier and the loads beside them (sessions 46-47)
  timeout 240 python3 scripts/gpu_copy_probe.py ${PROBE_ARGS:---kb 48 128 --kinds cp16 cp4 bulk} --out "$OUT" \
    >"$OUT/copy-probe.log" 2>&1
  summary+=("copy-probe: rc=$?" "$(grep -E '^(\||NVIDIA)' "$OUT/copy-probe.log")")
fi
if [[ " $PARTS " == *" stream-probe "* ]]; then
  # the loader-warp design measured outside the megakernel (session 50): what streaming weights across barriers buys
  probe_args=(${STREAM_ARGS:-qwen3-0.6b qwen2.5-0.5b llama-3.2-1b smollm-135m --spin-ns 2000 --slots 12})
  for inflight in 0 1 2; do
    modes=(stream)
    [[ $inflight == 0 ]] && modes=(interval stream relaxed copy)
    timeout 150 python3 scripts/gpu_stream_probe.py "${probe_args[@]}" --modes "${modes[@]}" --inflight "$inflight" \
      --out "$OUT/stream-probe-inflight$inflight" >"$OUT/stream-probe-inflight$inflight.log" 2>&1
    summary+=("stream-probe (in flight: $inflight, 0 = unbounded): rc=$?"
              "$(grep -E '^\| [a-z]' "$OUT/stream-probe-inflight$inflight.log" | grep -v ' / .* / .* / .* |')")
  done
fi
if [[ " $PARTS " == *" tests1 "* ]]; then
  run_tests "${TESTS1[@]}"
fi
if [[ " $PARTS " == *" tests2 "* ]]; then
  run_tests "${TESTS2[@]}"
fi
if [[ " $PARTS " == *" tests3 "* ]]; then
  run_tests "${TESTS3[@]}"
fi
if [[ " $PARTS " == *" mma "* ]]; then
  run_tests mma "mma_gemv" tests/test_gpu_decode.py
fi
collect_tests numerics kernels rest mma
tune_candidates() {  # preset capacity position builds...: gpu_tune of the bake's default plan with candidate builds
  local preset=$1 capacity=$2 position=$3
  shift 3
  local log="$OUT/tune-$preset-p$position.log"
  timeout 240 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default "$@" --no-composite \
    --capacity "$capacity" --position "$position" --out "$OUT/p$position" >"$log" 2>&1
  summary+=("candidates tune ($preset at $position): rc=$?" "$(grep -E '^(==|\||timeline|phases|per-CTA)' "$log")")
}
run_selected_in_3_shards() {  # name prefix, -k expression: those GPU tests of tests/ in 3 concurrent shards
  local prefix=$1 select=$2 names=() i
  for ((i = 0; i < 3; i++)); do
    names+=("$prefix$i")
    OMP_NUM_THREADS=$(( $(nproc) / 3 )) run_tests "$prefix$i" "$select" --shard "$i/3" tests/ &
  done
  wait
  collect_tests "${names[@]}"
}
if [[ " $PARTS " == *" loader-flip "* ]]; then
  export MEGABAKE_EXPERIMENTAL_LAYOUTS=loader_warp
  TEST_LIMIT=${TEST_LIMIT:-300} run_selected_in_3_shards loader "qwen"
  tune_candidates qwen3-0.6b 4096 4000 no-loader loader-gate-1-drain-att
  tune_candidates qwen2.5-0.5b 4096 4000 no-loader loader-gate-1-drain-att
fi
if [[ " $PARTS " == *" loader-check "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-240} run_selected_in_3_shards qwen3- "qwen3"
fi
if [[ " $PARTS " == *" att-clocks "* ]]; then
  for preset in ${ATT_PRESETS:-qwen3-0.6b}; do
    tune_candidates "$preset" 4096 16 --phases --per-cta
    tune_candidates "$preset" 4096 4000 --phases --per-cta
  done
fi
if [[ " $PARTS " == *" kv-fence "* ]]; then
  # session 57's candidate (generate(plan, kv_fence=True)): each lane-group iteration's K/V rows issued together
  # behind a warp fence. Its GPU test (the plain loop's bits, Qwen2.5-0.5B's one-head slices among them), then the
  # default against it where the lane-group loop streams long chunks: the growth rows (Qwen2.5-0.5B, SmolLM-135M)
  # and Phi-3-mini (under 1.5x at 1000 / 4000)
  TEST_LIMIT=${TEST_LIMIT:-200} run_tests kv-fence "kv_pipeline_gives_bit_identical" tests/test_gpu_decode.py
  collect_tests kv-fence
  tune_candidates qwen2.5-0.5b 4096 4000 kv-fence short-slices
  tune_candidates smollm-135m 2048 2000 kv-fence short-slices
  [[ -n "${FENCE_PHI:-1}" ]] && tune_candidates phi-3-mini 4096 4000 kv-fence
fi
if [[ " $PARTS " == *" mma-buffers "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-240} run_tests mma-buffers "mma_attention_matches_the_lane_group_loop" \
    tests/test_gpu_decode.py
  collect_tests mma-buffers
  for spec in "qwen2.5-0.5b 8 4096 4000" "smollm-135m 8 2048 2000" "llama-3.2-1b 1 4096 4000"; do
    read -r preset batch capacity position <<<"$spec"
    log="$OUT/tune-$preset-b$batch-p$position.log"
    timeout 150 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default mma-two-buffers --no-composite \
      --batch "$batch" --capacity "$capacity" --position "$position" --out "$OUT/b$batch-p$position" >"$log" 2>&1
    summary+=("mma-buffers tune ($preset, batch $batch, at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
  done
fi
if [[ " $PARTS " == *" group-fold "* ]]; then
  # session 59's group_fold candidate (fused_split's O blocks merge up to 16 splits of their group; the items never
  # merge there): the default against it where batch 1 deals 16 splits, Qwen3-0.6B at 4000 and 1000, Llama-3.2-1B
  # at 4000 (gpu_tune's rel-L2 against the default: the fp32 order of the merge)
  tune_candidates qwen3-0.6b 4096 4000 group-fold
  tune_candidates qwen3-0.6b 4096 1000 group-fold
  tune_candidates llama-3.2-1b 4096 4000 group-fold
fi
if [[ " $PARTS " == *" split-cap "* ]]; then
  # what the split_cap feature builds since session 62 (codegen.default_mma_schedule + default_split_cap: the
  # tensor-core schedule, fused_o kept on, at most 16 splits a KV group), ~7 min: the kernel against its reference
  # (build4 / build5: Qwen2.5-0.5B / SmolLM-135M), then the default against that build at short, ~1000 and long
  # contexts. If it wins at long context and loses nothing elsewhere, run the whole GPU suite with
  # MEGABAKE_EXPERIMENTAL_LAYOUTS=split_cap exported (PARTS=tests-parallel) before it joins GPU_VERIFIED_FEATURES.
  TEST_LIMIT=${TEST_LIMIT:-150} run_tests split-cap \
    "fused_split_kernel_matches_the_reference and (build4 or build5)" tests/test_fused_split_gpu.py
  collect_tests split-cap
  for position in 4000 1000 16; do
    tune_candidates qwen2.5-0.5b 4096 "$position" fused-mma-schedule-cap16
  done
  for position in 2000 1000 16; do
    tune_candidates smollm-135m 2048 "$position" fused-mma-schedule-cap16
  done
  # a call brings back 8 files at most: the 7 logs, and the tune JSONs in one archive
  (cd "$OUT" && tar -czf tune-json.tar.gz p*/ && rm -rf p*/)
fi
if [[ " $PARTS " == *" split-cap-suite "* ]]; then
  # the GPU tests the split_cap feature can move, with it on: among the presets it changes only Qwen2.5-0.5B's modules
  # (tests/test_split_cap.py pins that: codegen.split_cap_fits_group), so the tests of the tests-parallel files whose
  # ids name qwen2.5-0.5b (15 in session 63), dealt round-robin over 4 pytest processes (156 s on an H100). They all
  # passed in session 64, so the feature joined GPU_VERIFIED_FEATURES (the export is harmless now).
  ids=$(MEGABAKE_EXPERIMENTAL_LAYOUTS=split_cap python3 -m pytest -m gpu -q -p no:cacheprovider --collect-only \
    -k "qwen2.5" "${TESTS3[@]:2}" tests/test_fused_o_gpu.py tests/test_global_down_gpu.py tests/test_mma_wide_gpu.py \
    tests/test_fused_mlp_gpu.py tests/test_fused_split_gpu.py tests/test_spare_warp_gpu.py \
    tests/test_loader_warp_gpu.py 2>/dev/null | grep "::")
  echo "$ids" >"$OUT/split-cap-suite-ids.txt"
  names=()
  for ((i = 0; i < 4; i++)); do
    names+=("scs$i")
    mapfile -t part < <(echo "$ids" | awk -v i="$i" 'NF && (NR - 1) % 4 == i')
    ((${#part[@]})) || continue
    MEGABAKE_EXPERIMENTAL_LAYOUTS=split_cap OMP_NUM_THREADS=$(( $(nproc) / 4 )) \
      TEST_LIMIT=${TEST_LIMIT:-500} run_tests "scs$i" "" "${part[@]}" &
  done
  wait
  collect_tests "${names[@]}"
fi
if [[ " $PARTS " == *" items-gate "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-240} run_tests items-gate "loader_warp_gives_the_fused_default_bits and qwen" \
    tests/test_loader_warp_gpu.py
  collect_tests items-gate
  for position in 4000 1000; do
    tune_candidates qwen3-0.6b 4096 "$position" loader-gate-1-drain-items
  done
  tune_candidates qwen2.5-0.5b 4096 4000 loader-gate-1-drain-items
  (cd "$OUT" && tar -czf tune-json.tar.gz p*/ && rm -rf p*/)
fi
if [[ " $PARTS " == *" early-kv "* ]]; then
  TEST_LIMIT=${TEST_LIMIT:-260} run_tests early-kv "mma_attention_matches_the_lane_group_loop" tests/test_gpu_decode.py
  collect_tests early-kv
  for spec in "llama-3.2-1b 1 4096 16 early-kv early-kv-l1" "llama-3.2-1b 1 4096 4000 early-kv early-kv-l1" \
      "smollm-135m 1 2048 16 early-kv early-kv-l1" "qwen3-0.6b 1 4096 16 early-kv-l1" \
      "qwen2.5-0.5b 1 4096 16 early-kv-l1"; do
    read -r preset batch capacity position builds <<<"$spec"
    log="$OUT/tune-$preset-b$batch-p$position.log"
    # shellcheck disable=SC2086
    timeout 120 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default $builds --no-composite \
      --batch "$batch" --capacity "$capacity" --position "$position" --out "$OUT/b$batch-p$position" >"$log" 2>&1
    summary+=("early-kv tune ($preset, batch $batch, at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
  done
fi
if [[ " $PARTS " == *" candidates "* ]]; then
  # the K/V prefetch into L1 instead of L2 (generate(plan, kv_prefetch_l1=True), a candidate since session 16)
  # and the split-KV merges (the preload and the spread merge: the default per plan since session 17). Their GPU
  # tests (bit-identical logits), then the default build against the L1 prefetch at position 2 (no merge there)
  TEST_LIMIT=240 run_tests candidates "merge_preload or kv_prefetch" tests/test_gpu_decode.py
  collect_tests candidates
  tune_candidates smollm-135m 128 2 kvpf-l1
  tune_candidates llama-3.2-1b 128 2 kvpf-l1
fi
if [[ " $PARTS " == *" candidates-long "* ]]; then
  # ... and against it and each merge alone at a long context (each preset at the largest bucket it allows),
  # with per-stage clocks there; the default spreads the merge only for one-KV-head models like gemma-2b (63
  # splits x 2048 outputs through one SM per layer at 4000) and preloads it elsewhere (codegen.default_merge)
  tune_candidates smollm-135m 2048 2000 kvpf-l1 merge-preload spread-merge
  tune_candidates llama-3.2-1b 4096 4000 kvpf-l1 merge-preload spread-merge
  tune_candidates gemma-2b 4096 4000 merge-preload spread-merge
fi
if [[ " $PARTS " == *" slices "* ]]; then
  # split-KV head slices (session 18, the default): against head_slices=False at a short context, per-stage
  # clocks included (gemma-2b: 8 query heads on one KV head; SmolLM 3 and Llama-1B 4 per KV head)
  tune_candidates gemma-2b 4096 16 no-slices
  tune_candidates smollm-135m 128 16 no-slices
  tune_candidates llama-3.2-1b 128 16 no-slices
fi
if [[ " $PARTS " == *" long-slices "* ]]; then
  # split-KV slices at long contexts (session 19, plan.attention.split_schedule): the default build against
  # long_slices=False (session 18: slices only while every split fits) where the two deal differently
  tune_candidates smollm-135m 2048 2000 short-slices
  tune_candidates gemma-2b 4096 4000 short-slices
  tune_candidates qwen2.5-0.5b 4096 4000 short-slices
fi
if [[ " $PARTS " == *" pass-chunks "* ]]; then
  # split-KV chunks in whole CTA passes (generate(plan, pass_chunks=True), a candidate since session 19): its GPU
  # test, then the default build against it where the two cut differently
  TEST_LIMIT=240 run_tests pass-chunks "pass_chunks" tests/test_gpu_decode.py
  collect_tests pass-chunks
  tune_candidates smollm-135m 2048 2000 pass-chunks
  tune_candidates qwen2.5-0.5b 4096 4000 pass-chunks
fi
if [[ " $PARTS " == *" kv-pipeline "* ]]; then
  # split-KV K/V rows loaded one loop iteration ahead (generate(plan, kv_pipeline=True), a candidate since session
  # 19): its GPU test (the same bits), then the default build against it at long contexts (MHA models first)
  TEST_LIMIT=240 run_tests kv-pipeline "kv_pipeline" tests/test_gpu_decode.py
  collect_tests kv-pipeline
  tune_candidates olmo-2-1b 4096 4000 kv-pipeline
  tune_candidates smollm-135m 2048 2000 kv-pipeline
  tune_candidates llama-3.2-1b 4096 4000 kv-pipeline
fi
if [[ " $PARTS " == *" long-candidates "* ]]; then
  # both session-19 candidates' timings in one call, sharing each preset's build (their GPU tests run in
  # tests-parallel): the K/V pipeline where a head streams long chunks (the two MHA presets under 1.5x at their
  # longest context), whole-pass chunks where they cut otherwise
  tune_candidates olmo-2-1b 4096 4000 kv-pipeline
  tune_candidates smollm-1.7b 2048 2000 kv-pipeline
  tune_candidates smollm-135m 2048 2000 kv-pipeline pass-chunks
  tune_candidates qwen2.5-0.5b 4096 4000 kv-pipeline pass-chunks
fi
if [[ " $PARTS " == *" fold-merge "* ]]; then
  # the split-KV merge folded into the O projection's staging (generate(plan, fold_merge=True), the default since
  # session 24; its GPU test runs in tests-parallel): the default build against the unfolded one where
  # 2..fold_splits splits are active, MHA models first (SmolLM-1.7B: 4 of 4 at 2027; OLMo-2-1B: 8 of 8 at 4000)
  TEST_LIMIT=200 run_tests fold-merge "fold_merge" tests/test_gpu_decode.py
  collect_tests fold-merge
  tune_candidates smollm-1.7b 2048 2027 no-fold-merge
  tune_candidates olmo-2-1b 4096 4000 no-fold-merge
  tune_candidates smollm-135m 2048 2000 no-fold-merge
  tune_candidates phi-3-mini 4096 4000 no-fold-merge
fi
if [[ " $PARTS " == *" prefetch-followup "* ]]; then
  # session 26's follow-ups in one call (~6 min?), now that no L2 weight prefetch precedes a ring-filled GEMV
  # (codegen.default_prefetch_bytes): does the K/V L2 prefetch before attention still pay at long contexts
  # (no-kvpf), does a deeper ring fill (ring5-gated: 4 chunks per warp before each barrier instead of 3) cover more
  # of the barrier wait, and does the 16 MB weight prefetch that the tensor-core batch-8 default keeps pay (pf0)?
  tune_candidates phi-3-mini 4096 4000 no-kvpf
  tune_candidates olmo-2-1b 4096 4000 no-kvpf
  log="$OUT/tune-llama-3.2-1b-ring5.log"
  timeout 150 python3 scripts/gpu_tune.py llama-3.2-1b --variants bake ring5-gated --no-composite --capacity 4096 \
    --position 16 --out "$OUT/p16" >"$log" 2>&1
  summary+=("ring5 tune (llama-3.2-1b at 16): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
  log="$OUT/tune-llama-3.2-1b-b8.log"
  timeout 150 python3 scripts/gpu_tune.py llama-3.2-1b --batch 8 --variants bake --builds default pf0 --no-composite \
    --capacity 128 --out "$OUT/b8" >"$log" 2>&1
  summary+=("batch-8 prefetch tune (llama-3.2-1b): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
fi
if [[ " $PARTS " == *" per-cta "* ]]; then
  # every CTA's phase clocks (timeline="phases-per-cta", session 26): its GPU test (the same logits; no CTA leaves
  # a grid barrier before the last one arrived), then where the barrier waits come from on Phi-3-mini at 4000
  # and Llama-1B at 16 (arrival skew vs the barrier's own latency, which CTAs arrive last)
  TEST_LIMIT=150 run_tests per-cta "timeline_build_accounts" tests/test_gpu_decode.py
  collect_tests per-cta
  # PER_CTA_CASES="smollm-135m 2048 16;qwen2.5-0.5b 4096 16" picks other "preset capacity position" cases
  IFS=';' read -r -a cases <<<"${PER_CTA_CASES:-phi-3-mini 4096 4000;llama-3.2-1b 4096 16}"
  for case in "${cases[@]}"; do
    read -r preset capacity position <<<"$case"
    log="$OUT/tune-$preset-per-cta-p$position.log"
    timeout 200 python3 scripts/gpu_tune.py "$preset" --variants bake --per-cta --phases --no-composite \
      --capacity "$capacity" --position "$position" --out "$OUT/per-cta-p$position" >"$log" 2>&1
    summary+=("per-CTA tune ($preset at $position): rc=$?" "$(grep -E '^(==|\||per-CTA|phases)' "$log")")
  done
fi
if [[ " $PARTS " == *" split-barrier "* ]]; then
  # session 27: the split grid barrier (the default since then: arrive before the next GEMV's ring fill and
  # prefetches, wait after them) against the one-call "atom" barrier before it. Its GPU test (bit-identical logits
  # over graph replays), then Phi-3-mini / OLMo-2 at 4000, Llama-1B / SmolLM at 16; per-CTA clocks of both builds on
  # Phi-3-mini and Llama-1B (did the barrier latency, last arrival to first release, drop?)
  TEST_LIMIT=150 run_tests split-barrier "red_barrier" tests/test_gpu_decode.py
  collect_tests split-barrier
  for case in "llama-3.2-1b 4096 16 --per-cta" "phi-3-mini 4096 4000 --per-cta" "olmo-2-1b 4096 4000" \
      "smollm-135m 2048 16"; do
    read -r preset capacity position extra <<<"$case"
    log="$OUT/tune-$preset-split-p$position.log"
    timeout 170 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default atom --no-composite $extra \
      --capacity "$capacity" --position "$position" --out "$OUT/split-p$position" >"$log" 2>&1
    summary+=("split-barrier tune ($preset at $position): rc=$?" "$(grep -E '^(==|\||per-CTA)' "$log")")
  done
fi
if [[ " $PARTS " == *" split-followup "* ]]; then
  # session 27's follow-ups on the split-barrier default, one call (~6 min?): with the arrival ahead of them, do
  # the L2 weight prefetches pay now (pf8mb / pf16mb on Llama-1B at 16 and Phi-3-mini at 4000, against none
  # before ring-filled GEMVs, the default) and does the K/V prefetch before attention (no-kvpf)? SmolLM-135M's
  # growth at 2000 against its new short step (budget: (0.369 + 0.013) x 1.15 = 0.439 ms) and its per-CTA clocks
  # at 16 (where its 151 barrier intervals go)
  tune_candidates llama-3.2-1b 4096 16 pf8mb pf16mb
  tune_candidates phi-3-mini 4096 4000 pf16mb no-kvpf
  # session 28: Qwen3-0.6B at 4000 is 2% over its growth budget (0.877 vs 0.859 ms GPU); its QKV stage's prefetch
  # phase (+29 us over 28 layers) and barrier (+56 us) grow with the K/V L2 prefetch's 16.4 MB per layer; its
  # attention takes 7.0 us per layer for 4.7 us of K/V: the K/V loads one iteration ahead were never measured on
  # GQA with head_dim 128 (2 positions per warp pass)
  tune_candidates qwen3-0.6b 4096 4000 no-kvpf kv-pipeline
  tune_candidates smollm-135m 2048 2000
  log="$OUT/tune-smollm-135m-per-cta-p16.log"
  timeout 150 python3 scripts/gpu_tune.py smollm-135m --variants bake --per-cta --phases --no-composite \
    --capacity 2048 --position 16 --out "$OUT/per-cta-p16" >"$log" 2>&1
  summary+=("per-CTA tune (smollm-135m at 16): rc=$?" "$(grep -E '^(==|\||per-CTA|phases)' "$log")")
fi
if [[ " $PARTS " == *" kvpf-cap "* ]]; then
  # session 29's split-followup: without the K/V prefetch Phi-3-mini at 4000 took 2.347 vs 2.435 ms and Qwen3-0.6B
  # 0.840 vs 0.878 (the whole first item asked for while the QKV GEMV streams weights). The cap keeps short contexts'
  # prefetch whole (one chunk) and asks for one CTA loop iteration's rows at long contexts
  TEST_LIMIT=200 run_tests kvpf-cap "kv_prefetch_gives" tests/test_gpu_decode.py
  collect_tests kvpf-cap
  tune_candidates phi-3-mini 4096 4000 no-kvpf kvpf-all
  tune_candidates qwen3-0.6b 4096 4000 no-kvpf kvpf-all
  tune_candidates llama-3.2-1b 4096 1000 no-kvpf kvpf-all
  tune_candidates smollm-135m 2048 16 no-kvpf
fi
if [[ " $PARTS " == *" batch-growth "* ]]; then
  # session 30: at batch 4 and 8 the step grows 3-7% past issue 12's budget (SmolLM-135M to 2027, Qwen2.5-0.5B to
  # 4000). Batch 8's per-stage clocks at both ends, and at the long end the split-KV candidates that change how a
  # CTA reads its chunk (K/V loads one iteration ahead, no K/V prefetch, chunks in whole CTA passes)
  for spec in "smollm-135m 2048 16" "smollm-135m 2048 2027" "qwen2.5-0.5b 4096 16" "qwen2.5-0.5b 4096 4000"; do
    read -r preset capacity position <<<"$spec"
    builds=(default)
    ((position > 16)) && builds+=(kv-pipeline no-kvpf pass-chunks)
    log="$OUT/tune-$preset-b8-p$position.log"
    timeout 140 python3 scripts/gpu_tune.py "$preset" --variants bake --builds "${builds[@]}" --no-composite --phases \
      --batch 8 --capacity "$capacity" --position "$position" --out "$OUT/b8-p$position" >"$log" 2>&1
    summary+=("batch-growth tune ($preset, batch 8, at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
  done
fi
if [[ " $PARTS " == *" mma-attention "* ]]; then
  # session 32: at batch 8 all the growth with context is attention, bound by each item's per-head arithmetic (7
  # query heads per item on Qwen2.5-0.5B cost 3.8x one head over the same K/V rows). Items of 2-8 heads scored and
  # summed on the tensor cores (session 33: the default, generate(plan) / mma_attention=False for the lane-group
  # loop): its GPU tests first, then the default against the lane-group loop where it deals such items: batch 8
  # at the long end (Qwen2.5-0.5B 7 heads, SmolLM-135M 3, Llama-3.2-1B 4). A 10-minute call holds the tests and
  # these; PARTS=mma-attention-b1 times batch 1 in another: Qwen3-0.6B (2 heads of 128) at 4000, and Qwen2.5-0.5B at
  # 16 and 4000, where batch 1 deals 1-head slices (the same bits) and only mma-schedule deals whole groups
  timeout 240 python3 -m pytest -m gpu -q -x tests/test_gpu_decode.py -k mma_attention \
    >"$OUT/pytest-gpu-mma-attention.log" 2>&1
  rc=$?
  summary+=("mma-attention GPU test: rc=$rc $(tail -1 "$OUT/pytest-gpu-mma-attention.log")")
  ((rc == 0)) && MMA_SPECS=("qwen2.5-0.5b 8 4096 4000" "smollm-135m 8 2048 2027" "llama-3.2-1b 8 4096 4000")
fi
if [[ " $PARTS " == *" mma-attention-b1 "* ]]; then
  MMA_SPECS+=("qwen2.5-0.5b 1 4096 4000" "qwen2.5-0.5b 1 4096 16" "qwen3-0.6b 1 4096 4000")
fi
if ((${#MMA_SPECS[@]})); then
    for spec in "${MMA_SPECS[@]}"; do
      read -r preset batch capacity position <<<"$spec"
      log="$OUT/tune-$preset-b$batch-mma-p$position.log"
      timeout 150 python3 scripts/gpu_tune.py "$preset" --variants bake --builds default lane-attention mma-schedule \
        --no-composite --phases --batch "$batch" --capacity "$capacity" --position "$position" \
        --out "$OUT/mma-b$batch-p$position" >"$log" 2>&1
      summary+=("mma-attention tune ($preset, batch $batch, at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
    done
fi
FUSED_SPECS=()  # fused-o / fused-o-more: the timings to run, "preset capacity position builds..."
FUSED_BUILDS="default fused-o fused-o-lane fused-o-kv kvpf-l1"
if [[ " $PARTS " == *" fused-o "* ]]; then
  # session 34 (built without a GPU): a step whose context fits the first split-KV chunk runs its attention (whole
  # KV groups, every CTA) and the O projection in one barrier interval (generate(plan, fused_o=True),
  # codegen.fused): one grid barrier and the O stage's staging less per layer at short contexts. Its GPU tests
  # first (the default build's bits where steps are split, fp32 order where fused, the reference executor, a
  # second run's bits, fused_kv_smem's bits), then GPU ms at 16 on SmolLM-135M against the default, the fused
  # build with whole groups on the fp32 lane loop (fused-o-lane), with the cached K/V rows in shared memory
  # (fused-o-kv), and the L1 K/V prefetch
  # (kvpf-l1, never timed at short contexts). PARTS=fused-o-more, in a call of its own: Qwen3-0.6B and
  # Qwen2.5-0.5B at 16, Qwen3-0.6B at 1000 (split steps: the default's bits, the branch's cost); then
  # PARTS=fused-o-llama: Llama-3.2-1B at 16
  timeout 240 python3 -m pytest -m gpu -q -x tests/test_fused_o_gpu.py >"$OUT/pytest-gpu-fused-o.log" 2>&1
  rc=$?
  summary+=("fused-o GPU tests: rc=$rc $(tail -1 "$OUT/pytest-gpu-fused-o.log")")
  ((rc == 0)) && FUSED_SPECS=("smollm-135m 2048 16 $FUSED_BUILDS")
fi
if [[ " $PARTS " == *" fused-o-times "* ]]; then
  # the same SmolLM-135M timings without the GPU tests, where tests-parallel (which runs them) passed already
  FUSED_SPECS+=("smollm-135m 2048 16 $FUSED_BUILDS")
fi
if [[ " $PARTS " == *" fused-o-more "* ]]; then
  FUSED_SPECS+=("qwen3-0.6b 4096 16 $FUSED_BUILDS" "qwen2.5-0.5b 4096 16 default fused-o fused-o-lane fused-o-kv"
                "qwen3-0.6b 4096 1000 default fused-o")
fi
if [[ " $PARTS " == *" fused-o-llama "* ]]; then
  FUSED_SPECS+=("llama-3.2-1b 4096 16 default fused-o fused-o-lane fused-o-kv")
fi
if ((${#FUSED_SPECS[@]})); then
  for spec in "${FUSED_SPECS[@]}"; do
    read -r preset capacity position builds <<<"$spec"
    log="$OUT/tune-$preset-fused-o-p$position.log"
    # shellcheck disable=SC2086  # builds: one word per build
    timeout 180 python3 scripts/gpu_tune.py "$preset" --variants bake --builds $builds \
      --no-composite --capacity "$capacity" --position "$position" --out "$OUT/fused-o-p$position" >"$log" 2>&1
    summary+=("fused-o tune ($preset at $position): rc=$?" "$(grep -E '^(==|\|)' "$log")")
  done
fi
if [[ " $PARTS " == *" balance "* ]]; then
  # session 30: the bake's tiling with rows per tile balanced per stage (gpu_tune variant bake-balanced,
  # autotune.rebalanced_tuning) against the bake's own, with per-phase clocks: Qwen3-0.6B @16 (O and down: 512 of
  # 1056 warps busy with tiles of 2), Phi-3-mini @1000 (O and down: 1536 tiles of 2 rows, 480 warps get two) and
  # SmolLM-135M @16 (QKV, O, down). Same logits required (gpu_tune checks them against the first variant)
  for spec in "qwen3-0.6b 4096 16" "phi-3-mini 4096 1000" "smollm-135m 2048 16"; do
    read -r preset capacity position <<<"$spec"
    log="$OUT/tune-$preset-balance-p$position.log"
    timeout 240 python3 scripts/gpu_tune.py "$preset" --variants bake bake-balanced --no-composite --phases \
      --capacity "$capacity" --position "$position" --out "$OUT/balance-p$position" >"$log" 2>&1
    summary+=("balance tune ($preset at $position): rc=$?" "$(grep -E '^(==|\||timeline)' "$log")")
  done
fi
if [[ " $PARTS " == *" host-gap "* ]]; then
  # session 31: the benchmark's cells read the synchronized call 33-58 us over the GPU time where
  # gpu_host_cost.py reads 11; walk from one setting to the other (gpu_host_cost.py --bench-like, module doc)
  for spec in "smollm-135m 2048 240" "llama-3.2-1b 4096 320"; do  # preset, capacity, seconds (rows print as measured)
    read -r preset capacity limit <<<"$spec"
    log="$OUT/host-gap-$preset.log"
    timeout "$limit" python3 scripts/gpu_host_cost.py "$preset" --capacity "$capacity" --bench-like \
      --out "$OUT/host-gap-$preset" >"$log" 2>&1
    summary+=("host gap ($preset): rc=$?" "$(grep -E '^\|' "$log")")
    rm -rf "$OUT/host-gap-$preset/packages"  # the device returns at most 8 files
  done
fi
if [[ " $PARTS " == *" hang-probe "* ]]; then
  # the tensor-core cases' kernel steps built with the barrier watchdog (scripts/gpu_hang_probe.py)
  timeout 400 python3 scripts/gpu_hang_probe.py --rounds 3 --out "$OUT" >"$OUT/hang-probe.log" 2>&1
  summary+=("hang probe: rc=$? $(tail -1 "$OUT/hang-probe.log")")
fi
if [[ " $PARTS " == *" smoke "* ]]; then
  timeout 240 python3 scripts/gpu_smoke.py "${PRESETS[@]}" --out "$OUT" --steps 4 --timeout 110 >"$OUT/smoke.log" 2>&1
  summary+=("smoke: rc=$?" "$(sed -n '/== smoke ==/,$p' "$OUT/smoke.log")")
fi
if [[ " $PARTS " == *" bench "* ]]; then
  # BENCH_ARGS="--tiling 2x4+preload+ring4 --attention-preload" benches a chosen kernel instead of the default.
  # BENCH_LIMIT: seconds for the benchmark (default 560; less where other parts share the call).
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
  read -r -a bench_args <<<"${BENCH_ARGS:-}"  # BENCH_ARGS is a list of words
  timeout "${BENCH_LIMIT:-560}" python3 benchmarks/decode.py --presets "${PRESETS[@]}" --out "$work" "${resume[@]}" \
    "${bench_args[@]}" >"$OUT/bench.log" 2>&1
  rc=$?
  mkdir -p "$OUT/bench"
  # decode.md / decode.png / results.json without --positions; matrix.md (and the archive's matrix.*) with it
  cp "$work"/decode.md "$work"/decode.png "$work"/results.json "$work"/decode.log "$work"/matrix.md "$OUT/bench"/ \
    2>/dev/null
  # matrix mode (--positions): its chart, JSON and per-cell timings travel in the archive too
  (
    cd "$work" || exit
    shopt -s nullglob
    archived=(./*-report.json ./*-package.tar.gz)
    for name in matrix.png matrix.json matrix; do [[ -e $name ]] && archived+=("./$name"); done
    tar -czf "$OUT/bench/artifacts.tar.gz" --transform 's,^\./,bench/,' "${archived[@]}"
  )
  summary+=("bench: rc=$rc" "$(cat "$work/decode.md" "$work/matrix.md" 2>/dev/null)")
fi
if [[ " $PARTS " == *" tune "* ]]; then
  # VARIANTS="default t2u4-pipe ..." limits the sweep (names: python3 scripts/gpu_tune.py --help)
  timeout 560 python3 scripts/gpu_tune.py "${PRESETS[@]}" --out "$OUT" ${VARIANTS:+--variants $VARIANTS} \
    >"$OUT/tune.log" 2>&1
  summary+=("tune: rc=$?" "$(sed -n '/^== /,$p' "$OUT/tune.log")")
fi
printf '%s\n' "${summary[@]}"
