#!/usr/bin/env bash
# One device call measures everything: `bash bench/gpu_run.sh [probe,tower,ingest,search|all]` (default all).
#   probe — what the box offers (bench/gpu_probe.py); tower — tower and LM pass micro-benchmarks with a profile
#   ingest — GPU tests, then ingestion at 448 px square, mixed <= 640 px and 12-MP photos; photos — 12-MP only
#   graphs, fast_search, fused, fused_search, compile, compiled_search — one setting on vs off, side by side
#   report — issue 12's side-by-side ingestion report (ours / official / raw / FLOP limit) + the load test
#   search — ANN at 1M x 2048, core reuse, search latency at 1M references (448 px, photos), the load test
#   Later sections (each with a comment above it) are the measurements the README's benchmark table cites.
# Each step runs under its own time limit, samples GPU utilisation, and logs to $OUT/<step>.log; the last
# lines of every step are printed. Carry .whl (transformers >= 5.19 and the project's pure-Python deps).
# DRY_RUN=1 prints each step's command instead of running it (no GPU needed): what a section would measure.
set -uo pipefail
section=${1:-all}
[ "$section" = all ] && section=probe,tower,ingest,compile,search,compiled_search
OUT=${OUT:-/tmp/rs-out}
CKPT=/tmp/rs-2b
if [ "${DRY_RUN:-0}" = 1 ]; then
  step() { local name=$1 limit=$2 tail_n=$3; shift 3; echo "$name (limit ${limit}s, last $tail_n lines): $*"; }
  grep() { :; }  # the sections end by summarising their logs: there are none
else
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, torchvision; print('torch', torch.__version__, 'torchvision', \
torchvision.__version__, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"

if [ ! -d "$CKPT" ]; then
  python3 -c "from retrieval.qwen.checkpoint import make_test_model as m; m('$CKPT', 'reranker', size='2b', dtype='bfloat16')"
fi

# step NAME SECONDS TAIL CMD...: run with a limit, GPU utilisation sampled every 100 ms, log kept
step() {
  local name=$1 limit=$2 tail_n=$3
  shift 3
  echo "===== $name ($(date +%H:%M:%S), limit ${limit}s)"
  mkdir -p /tmp/rs-util  # the samples stay on the box (a call brings back only so many files); the mean is printed
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "/tmp/rs-util/$name.txt" 2>/dev/null &
  local sampler=$!
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  kill $sampler 2>/dev/null
  tail -n "$tail_n" "$OUT/$name.log"
  awk -v n="$name" '{s+=$1; c++} END {if (c) printf "[%s] rc=%s, mean GPU utilisation %.0f%% over %.1f s\n", n, "'$rc'", s/c, c/10}' \
    "/tmp/rs-util/$name.txt"
}
fi

# The measurements the sections share, on the 2B checkpoint: NAME LIMIT TAIL, then what varies, then flags.
# gpu_tests LIMIT TAIL PYTEST-ARGS...: the GPU test suite (one step name, whatever the selection).
gpu_tests() { local l=$1 t=$2; shift 2; step gpu_tests "$l" "$t" python3 -m pytest -q -p no:cacheprovider -m gpu "$@"; }
# search448 NAME LIMIT TAIL REPEATS [FLAGS]: search p50 with 448 px candidates against a 1M-reference index. Eager
# passes and transformers' kernels unless FLAGS say --cuda-graphs, --fused (the product's defaults, the bench's since
# search39): the sections before search39 were measured so.
search448() {
  local n=$1 l=$2 t=$3 r=$4; shift 4
  step "$n" "$l" "$t" python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats "$r" --preprocess gpu-nvjpeg --no-cuda-graphs --no-fused "$@"
}
# photos NAME LIMIT TAIL REFERENCES REPEATS [FLAGS]: search p50 with a 12-MP candidate against 12-MP references.
photos() {
  local n=$1 l=$2 t=$3 refs=$4 r=$5; shift 5
  step "$n" "$l" "$t" python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references "$refs" --repeats "$r" --preprocess gpu-nvjpeg --no-cuda-graphs --no-fused "$@"
}
# core NAME LIMIT TAIL REPEATS [FLAGS]: 1 image x 8 instructions and rerank K (bench/core_reuse.py).
# core NAME LIMIT TAIL REPEATS [FLAGS]: bench/core_reuse.py; a new query image's package goes into the package store
# unless FLAGS say --query-tier (the server's way, the bench's default since final51): the sections before were so.
core() {
  local n=$1 l=$2 t=$3 r=$4; shift 4
  step "$n" "$l" "$t" python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats "$r" --no-query-tier "$@"
}
# ingest NAME LIMIT TAIL 448|mixed|12mp [FLAGS]: ingestion of one workload (preprocessing on the GPU unless FLAGS say).
ingest() {
  local n=$1 l=$2 t=$3 workload
  case $4 in
    448) workload="--side 448 --square --images 512" ;;
    mixed) workload="--side 640 --images 512" ;;
    12mp) workload="--side 4032 --images 64 --batch-size 16" ;;
  esac
  shift 4
  step "$n" "$l" "$t" python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" $workload \
    --preprocess "${PRE:-gpu-nvjpeg}" "$@"
}
# load NAME LIMIT TAIL REFERENCES INGEST CLIENTS SECONDS [FLAGS]: the load test. FUSED=true|false|auto before the
# call sets RUBRICSEARCH_FUSED_KERNELS for the server (false unless set: the setting's default before search39),
# GRAPHS_ENV=true|false RUBRICSEARCH_CUDA_GRAPHS.
load() {
  local n=$1 l=$2 t=$3 refs=$4 during=$5 clients=$6 seconds=$7; shift 7
  local settings=(RUBRICSEARCH_FUSED_KERNELS=${FUSED:-false} ${GRAPHS_ENV:+RUBRICSEARCH_CUDA_GRAPHS=$GRAPHS_ENV})
  step "$n" "$l" "$t" ${settings[@]:+env "${settings[@]}"} python3 bench/load_search.py --size 2b --checkpoint "$CKPT" \
    --side 448 --references "$refs" --ingest-during "$during" --clients "$clients" --seconds "$seconds" \
    --preprocess gpu-nvjpeg "$@"
}

# revert_ab REVERT TRACE_TAIL: 448 px at the defaults vs --revert REVERT (5 runs a process, alternating), a trace of
# the new state, then the mixed set both ways (3 runs); the summary lines of every log.
revert_ab() {
  local revert=$1 trace_tail=$2
  for arm in a b; do
    ingest "ingest_448_$arm" 80 2 448 --fused --cuda-graphs --repeats 5
    ingest "ingest_448_old_$arm" 80 2 448 --fused --cuda-graphs --repeats 5 --revert "$revert"
  done
  ingest ingest_448_trace 120 "$trace_tail" 448 --fused --cuda-graphs --torch-profile
  ingest ingest_mixed 80 2 mixed --fused --cuda-graphs --repeats 3
  ingest ingest_mixed_old 80 2 mixed --fused --cuda-graphs --repeats 3 --revert "$revert"
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation\|batches;\|busy" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

section_probe() { step gpu_probe 60 20 python3 bench/gpu_probe.py; }
section_tower() {
  step tower_probe 150 25 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 --probe
}
section_ingest() {
  gpu_tests 120 6 tests/test_gpu.py -o addopts=""
  for pre in official gpu-nvjpeg; do
    PRE=$pre ingest "ingest_448_$pre" 75 21 448
  done
  ingest ingest_mixed 75 21 mixed
  ingest ingest_12mp 90 21 12mp
  step preprocess_dev 90 8 python3 bench/gpu_preprocess_deviation.py --checkpoint "$CKPT" --device cuda --photos 12
  step fp8_packages 60 5 python3 bench/fp8_packages.py --checkpoint "$CKPT" --device cuda --images 24
}
section_compile() {
  gpu_tests 200 6 tests/test_gpu.py -o addopts=""
  step compile_check 120 6 python3 bench/compile_check.py --checkpoint "$CKPT" --device cuda --images 64
  for shape in 448 mixed; do
    name=${shape/mixed/640}
    ingest "ingest_${name}_eager" 50 21 $shape
    ingest "ingest_${name}_compiled" 130 21 $shape --compile dynamic
  done
}
section_search() {
  core core_reuse 90 16 6
  search448 search_448 100 9 6
  photos search_photo 90 9 32 5
  load load_search 140 9 400 256 1,4,16,64 12
  step ann_gpu 90 4 python3 bench/ann_recall.py --device-search torch --sizes 1m --dim 2048 --data lowrank \
    --queries 200
}

# Run 2026-11-26 (a slower box; README cites it with trace62): an eager tower pass with its grid-derived
# inputs computed on the host (vision.PRECOMPUTED, after trace57's 348 ms of tower-thread syncs) vs --revert
# tower-sync, alternating, at 448 px, the mixed set and 12-MP photos; the tower's GPU tests first.
section_sync61() {
  gpu_tests 120 6 tests/test_gpu_tower.py -o addopts="" -k "not compiled"
  grep -E "FAILED|Error" "$OUT/gpu_tests.log" | head -20; rm -f "$OUT/gpu_tests.log"  # a call returns 8 files
  ingest ingest_448_a 80 2 448 --fused --cuda-graphs --repeats 3
  ingest ingest_448_old_a 80 2 448 --fused --cuda-graphs --repeats 3 --revert tower-sync
  ingest ingest_448_old_b 80 2 448 --fused --cuda-graphs --repeats 3 --revert tower-sync
  ingest ingest_448_b 80 2 448 --fused --cuda-graphs --repeats 3
  ingest ingest_12mp_old 120 2 12mp --fused --cuda-graphs --repeats 2 --batch-size 64 --revert tower-sync
  ingest ingest_12mp 120 2 12mp --fused --cuda-graphs --repeats 2 --batch-size 64
  ingest ingest_mixed 80 2 mixed --fused --cuda-graphs --repeats 2
  ingest ingest_mixed_old 80 2 mixed --fused --cuda-graphs --repeats 2 --revert tower-sync
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation\|batches;" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# sync61 on a slower box was noisy at 448 px (222.7 / 184.4 vs 169.9 / 177.0) and its 12-MP steps ran past their
# limits before a run ended: the 448 px A/B again with 5 runs a process, a trace of the new state, the mixed A/B.
section_trace62() { revert_ab tower-sync 70; }

# As of commit 63ee178 (an experiment, reverted after this: no gain). trace62 put the LM stage at 85 % of the wall
# and the GPU idle 39 %: the embed stage on two threads (the next batch's prompts and LM pass queued while one waits
# for its read-back) vs --revert embed-ahead, alternating; the pipeline's functions timed per thread, and a trace
# of the new state (GPU busy, to hold against trace62's 61 %).
section_embed63() {
  ingest ingest_448_probes 80 45 448 --fused --cuda-graphs --host-probes
  revert_ab embed-ahead 30
}

# The probes of embed63 put both launching threads at ~180-195 ms of host time per batch of 64 (tower thread 178 ms,
# LM worker 194 ms) for ~90 ms of GPU work each: eager launches under the GIL. Bulk CUDA graphs (opt-in) replay
# both passes; trace57 found them slower. Where a graphed run's time goes (probes, trace), and the A/B once more.
section_graphs64() {
  ingest ingest_448_bulk_probes 80 40 448 --fused --cuda-graphs --bulk-graphs --host-probes
  ingest ingest_448_bulk_trace 120 40 448 --fused --cuda-graphs --bulk-graphs --torch-profile
  for arm in a b; do
    ingest "ingest_448_bulk_$arm" 80 2 448 --fused --cuda-graphs --bulk-graphs --repeats 5
    ingest "ingest_448_$arm" 80 2 448 --fused --cuda-graphs --repeats 5
  done
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation\|busy\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# The final state of 2026-11-26 (after embed63's experiment was reverted): the GPU tests but the compiled ones, issue
# 14's load once more (not measured since check55), and 12-MP photos with a longer limit than sync61's slow box had.
section_final65() {
  gpu_tests 150 6 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
  FUSED=auto load load_final 150 7 200 256 1,16,64 10 --criteria 0
  ingest ingest_12mp 170 2 12mp --fused --cuda-graphs --repeats 2 --batch-size 64
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Each pass's MFU at ingestion batch size with the rotary kernel (trace57's 0.42 for the tower was before it; rope58's
# pass_profile log did not come back), and bulk CUDA graphs at steady state: 2048 images at 448 px, where two
# captures (the 64-image batch, the first claim's 8) serve 30-odd replays, alternating with the eager default
# (graphs64 saw 512).
section_mfu66() {
  step pass_profile 150 40 python3 bench/pass_profile.py --checkpoint "$CKPT" --fused --cuda-graphs --top 8
  for arm in a b; do
    ingest "ingest_2048_bulk_$arm" 90 2 448 --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2
    ingest "ingest_2048_$arm" 90 2 448 --fused --cuda-graphs --images 2048 --repeats 2
  done
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Issue 12's side-by-side report at this round's state and the product's defaults (fused kernels, CUDA graphs, photo
# claims of 8): each workload with the official class path, the raw transformers pieces and the FLOP limit.
section_report67() {
  ingest ingest_448 150 24 448 --fused --cuda-graphs --baselines
  ingest ingest_mixed 150 24 mixed --fused --cuda-graphs --baselines
  ingest ingest_12mp 220 24 12mp --fused --cuda-graphs --batch-size 64 --baselines
  rm -f "$OUT/ingest.json"
}

# bulk_ab LIMIT SHAPE...: bulk CUDA graphs vs eager (fused kernels and small graphs in both), alternating processes of 2
# runs over 2048 images, two rounds; the summary lines of every log.
bulk_ab() {
  local limit=$1 arm shape; shift
  for arm in a b; do
    for shape in "$@"; do
      ingest "ingest_${shape}_bulk_$arm" "$limit" 2 "$shape" --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2
      ingest "ingest_${shape}_$arm" "$limit" 2 "$shape" --fused --cuda-graphs --images 2048 --repeats 2
    done
  done
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|MFU\|utilisation\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Run on the work tree just before commit 6792cd0, which differs in two things: BULK_IMAGE_PATCHES (1,024 then) and
# float32 bulk LM graphs (keyed by exact lengths then).
# Bulk CUDA graphs keyed by bucketed sizes (retrieval/qwen/packed.pack_key, graphed_tower.tower_key then): the LM's as
# the eager packed pass with pads after the sequences, the tower's with pads after the images, so a mixed-size set's
# batches share a few graphs (the padded, exactly keyed graphs before lost 8-13 % on it). The GPU tests but the
# compiled ones, then the mixed set at steady state (2048 images), bulk graphs vs eager, alternating.
section_bucket68() {
  gpu_tests 170 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
  bulk_ab 100 mixed
}

# As of commit 6792cd0. After bucket68 (mixed set: LM graphs replayed, the towers stayed eager, its images being over
# 1,024 patches, and the float32 bulk test met a capture the loop attention refuses): the bulk tests, then bulk graphs
# vs eager, alternating, at 448 px and on the mixed set (towers graphed up to 2,048 patches an image), 2048 images each.
section_bucket69() {
  gpu_tests 120 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "bulk"
  bulk_ab 90 448 mixed
}

# As of commit 6792cd0 (its reverts tower-buckets and bulk-size are gone with what they switched back). After bucket69
# (bulk graphs +5 % at 448 px and on the mixed set, on one box): what the tower's buckets cost at 448 px
# (their pads against keys by tuple of grids: --revert tower-buckets) and what graphing the mixed set's towers brings
# (--revert bulk-size: images up to 1,024 patches only), each beside the eager default, 2048 images. One round per
# call (ROUND=a, then ROUND=b on the same box: the steps of one call would not fit 10 minutes).
section_bucket70() {
  local r=${ROUND:-a}
  ingest "ingest_448_bulk_$r" 90 2 448 --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2
  ingest "ingest_448_tuples_$r" 90 2 448 --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2 \
    --revert tower-buckets
  ingest "ingest_448_$r" 90 2 448 --fused --cuda-graphs --images 2048 --repeats 2
  ingest "ingest_mixed_bulk_$r" 90 2 mixed --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2
  ingest "ingest_mixed_small_$r" 90 2 mixed --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2 \
    --revert bulk-size
  ingest "ingest_mixed_$r" 90 2 mixed --fused --cuda-graphs --images 2048 --repeats 2
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|utilisation\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# As of commit 6792cd0. Round a of bucket70: graphing the mixed set's towers cost (209.9 vs 234.1 with them eager),
# keys by tuple gained nothing at 448 px, and every first run was the slow one. The LM's bulk graphs alone (--revert
# tower-bulk) vs both vs eager, at 448 px and on the mixed set, 3 runs a process.
section_bucket71() {
  local r=${ROUND:-a}
  for shape in 448 mixed; do
    ingest "ingest_${shape}_lm_$r" 100 2 "$shape" --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 3 \
      --revert tower-bulk
    ingest "ingest_${shape}_bulk_$r" 100 2 "$shape" --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 3
    ingest "ingest_${shape}_$r" 100 2 "$shape" --fused --cuda-graphs --images 2048 --repeats 3
  done
  rm -f "$OUT/ingest.json"
  grep -H "runs:\|utilisation\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# The state after bucket71: the LM's bulk graphs keyed by bucketed packed sizes, the tower's only for batches of one
# image length (keyed by their tuple of grids, as before), bulk graphs on by default. The GPU tests but the compiled
# ones, then bulk graphs vs eager, alternating, at 448 px and on the mixed set, 2048 images each.
section_final72() {
  gpu_tests 150 6 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
  bulk_ab 80 448 mixed
}

# final72 ran past its call before its mixed-set logs came back (a slow box; the 448 px A/B and the GPU tests did): the
# mixed set at the final state, bulk graphs vs eager; issue 14's load test with bulk graphs on (the server's default
# now) while an ingestion runs; issue 12's side-by-side report at the defaults for 448 px and the mixed set (12-MP
# photos take no bulk graph: report67's row stands for them). The JSON summaries stay on the box.
section_final74() {
  local json=(--json /tmp/rs-ingest.json)
  ingest ingest_mixed_bulk 80 2 mixed --fused --cuda-graphs --bulk-graphs --images 2048 --repeats 2 "${json[@]}"
  ingest ingest_mixed_eager 80 2 mixed --fused --cuda-graphs --images 2048 --repeats 2 "${json[@]}"
  FUSED=auto load load_bulk 130 7 200 256 1,16,64 10 --criteria 0
  ingest ingest_448 110 24 448 --fused --cuda-graphs --bulk-graphs --baselines "${json[@]}"
  ingest ingest_mixed 120 24 mixed --fused --cuda-graphs --bulk-graphs --baselines "${json[@]}"
  grep -H "runs:\|utilisation\|graph_captures" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Issue 12's side-by-side report at the defaults of final72 (fused kernels, CUDA graphs, bulk graphs): the three
# workloads, each with the official class path, the raw transformers pieces and the FLOP limit (as report67).
section_report75() {
  local json=(--json /tmp/rs-ingest.json)
  ingest ingest_448 120 24 448 --fused --cuda-graphs --bulk-graphs --baselines "${json[@]}"
  ingest ingest_mixed 130 24 mixed --fused --cuda-graphs --bulk-graphs --baselines "${json[@]}"
  ingest ingest_12mp 220 24 12mp --fused --cuda-graphs --bulk-graphs --batch-size 64 --baselines "${json[@]}"
}

# After a review of the final state: the bulk-graph GPU tests again (a batch with fewer real and image tokens on the
# captured key; the one-length rule over whole images).
section_check76() { gpu_tests 120 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "bulk"; }

# Float8 linear layers in both passes vs bf16 (run 2026-11-26: slower, cosine 0.962; README), 64
# images of 448 px (bench/fp8_passes.py: pass times and the embeddings' cosine), with and without the fused kernels;
# the activations quantised by separate kernels and by one torch.compile'd kernel.
section_fp8_77() {
  step fp8_passes 220 12 python3 bench/fp8_passes.py --checkpoint "$CKPT" --fused
  step fp8_passes_plain 200 12 python3 bench/fp8_passes.py --checkpoint "$CKPT"
}

source "$(dirname "$0")/gpu_sections_past.sh"  # the earlier sections (before probe29, profile40..check49, trace57..final60, final51..final56)
source "$(dirname "$0")/gpu_sections_ingest.sh"  # ab29 to final50
source "$(dirname "$0")/gpu_sections_idle.sh"  # report78 to check87
IFS=, read -ra wanted <<< "$section"
for name in "${wanted[@]}"; do
  "section_$name"
done
