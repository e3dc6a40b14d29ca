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
# after_before REVERT: GPU tests, then 448 px after and before (REVERT), alternating processes of 3 timed runs; the
# stage split with the host probes; 12-MP photos after and before; the mixed set. ab29 and ab30 differ in REVERT.
after_before() {
  local old=$1
  gpu_tests 150 4 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled and not 2b"
  for r in 1 2; do
    ingest ingest_448_new_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3
    ingest ingest_448_before_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 "$old"
  done
  ingest ingest_448_probes 100 2 448 --fused --cuda-graphs --bulk-graphs --host-probes
  ingest ingest_12mp_new 150 2 12mp --fused --repeats 2
  ingest ingest_12mp_before 150 2 12mp --fused --repeats 2 "$old"
  ingest ingest_mixed_new 120 2 mixed --fused --cuda-graphs --bulk-graphs --repeats 2
  grep -h -B2 -A50 "GIL probe" "$OUT"/ingest_448_probes.log
  grep -H "runs:\|^ingest:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# After probe29: packing on a thread of its own, the LM's ids padded in numpy, fewer torch calls per image on the
# tower thread (cuts, lookups), against --revert pack,pad (the cuts and lookups stay new).
section_ab29() { after_before --revert=pack,pad; }

# After ab29 (the pack stage alone ran 190 ms a batch, the store stage 370 behind 4 writers at 5 ms a package):
# a batch cut into its packages with one torch call per kind, and written from one host copy per kind, against
# --revert of everything since probe29 that can be reverted.
section_ab30() { after_before --revert=pack,pad,writes,cuts; }

# After ab30 the store stage (blobs, the package files behind the writers, one sync) is the slowest: 8 package
# writers against 4, alternating.
section_writers30() {
  for r in 1 2; do for w in 4 8; do
    ingest "ingest_448_w${w}_$r" 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --writer-threads $w; done; done
  grep -H "runs:\|utilisation\|  store  \|  sync  " "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Is the store stage bound by the disk? Package-sized files + one syncfs per batch, then 448 px ingestion, each
# with its files on the disk (/tmp) and in memory (/dev/shm): the gap is what the disk costs the pipeline.
section_disk30() {
  gpu_tests 150 4 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled and not 2b"
  [ "${DRY_RUN:-0}" = 1 ] || df -h /tmp /dev/shm  # not a step: how much room each place has
  for dir in /tmp /dev/shm; do
    step "disk_probe${dir//\//_}" 90 3 python3 bench/disk_probe.py --dir "$dir" --files 2048 --batch 64 --size-mb 1.6
  done
  for r in 1 2; do for dir in /tmp /dev/shm; do
    TMPDIR=$dir ingest "ingest_448${dir//\//_}_$r" 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3; done; done
  grep -H "runs:\|utilisation\|  store  \|  sync  " "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# After disk30: the sync on a thread of its own, a batch's files shared among the writers, against the revert.
section_ab31() { after_before --revert=sync,fanout; }

# ab31 at 2048 images (seven stage threads fill and drain in ~0.5 s), then rerank K and issue 14's load test.
section_steady31() {
  for r in 1 2; do for arm in new before; do ingest "ingest_448_2048_${arm}_$r" 120 2 448 --fused --cuda-graphs \
    --bulk-graphs --images 2048 $([ $arm = before ] && echo --revert=sync,fanout); done; done
  core core_reuse 120 10 4 --cuda-graphs --fused --only rerank --ks 20,50
  FUSED=true load load_search 150 12 200 256 1,16,64 10
  grep -H "runs:\|^ingest:\|MFU\|utilisation\|  embed  \|  sync  " "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

section_photos() { ingest ingest_12mp 90 21 12mp; }
# Which kernels hold the passes back (bench/kernel_probe.py): tower attention kernels, rerank 50 by kernel class.
section_kernels32() { step kernel_probe 300 80 python3 bench/kernel_probe.py --checkpoint "$CKPT"; }
# After kernels32: photo runs through cuDNN (tower) and the fused SwiGLU (LM), each against its revert, alternating;
# final32 (on an H100) leaves out the kernel probe and adds 448 px ingestion against both reverts; final33 adds
# cuDNN for equal LM lengths (in the cudnn revert) and the final layer for last tokens only (revert "last").
section_ab32() { kernels_ab 1 swiglu; }
section_final32() { kernels_ab 0 swiglu swiglu,cudnn; }
section_final33() { kernels_ab 0 last,swiglu last,swiglu,cudnn; }
kernels_ab() {
  gpu_tests 200 6 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "cudnn or swiglu or graphed_tower_matches or fused or packed or rerank"
  [ "$1" = 0 ] || step kernel_probe 150 75 python3 bench/kernel_probe.py --checkpoint "$CKPT" --only attention,rerank
  for r in 1 2; do for rev in "" cudnn; do ingest "ingest_12mp_${rev:-new}_$r" 100 3 12mp --fused --repeats 2 ${rev:+--revert=$rev}; done; done
  for rev in "" $2; do n=${rev:-new}; core "core_${n//,/_}" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 ${rev:+--revert=$rev}; done
  [ "$1" = 1 ] || for rev in "" $3; do n=${rev:-new}
    ingest "ingest_448_${n//,/_}" 100 3 448 --fused --cuda-graphs --bulk-graphs --repeats 3 ${rev:+--revert=$rev}; done
  grep -H "runs:\|MFU\|utilisation\|tower attention" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'  || :
}
# After final33 (the LM's cuDNN path dropped: no gain): the GPU tests but the compiled ones, photos against the cudnn
# revert, rerank K with a noise-PNG candidate against the last,swiglu revert and with a JPEG decoded by nvJPEG.
section_final34() {
  gpu_tests 240 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "not compiled"
  for rev in "" cudnn; do ingest "ingest_12mp_${rev:-new}" 100 3 12mp --fused --repeats 2 ${rev:+--revert=$rev}; done
  for rev in "" last,swiglu; do n=${rev:-new}
    core "core_${n//,/_}" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 ${rev:+--revert=$rev}; done
  core core_jpeg 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 --jpeg --preprocess gpu-nvjpeg
  grep -H "runs:\|MFU\|utilisation\|tower attention" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'  || :
}
# The final state: what a new image count costs cuDNN, the tower's cuDNN tests, issue 12's report with default
# settings (ingestion side by side with the official class path, raw pieces and the FLOP limit; search), and
# 12-MP photos with fused kernels over 3 timed runs (the first pays for the cuDNN plans).
section_final35() {
  step kernel_probe 120 12 python3 bench/kernel_probe.py --checkpoint "$CKPT" --only attention
  gpu_tests 120 4 tests/test_gpu_tower.py -o addopts="" -s -k "cudnn"
  ingest ingest_448 120 26 448 --baselines
  ingest ingest_mixed 120 26 mixed --baselines
  ingest ingest_12mp 150 26 12mp --baselines
  search448 search_448 100 12 6
  ingest ingest_12mp_fused 100 4 12mp --fused --repeats 3
}
# After final35: 12-MP photos with fused kernels, eager vs the tower's blocks compiled (RUBRICSEARCH_COMPILE_BLOCKS;
# static shapes: photos of one size), 3 timed runs each (the first also compiles and builds the cuDNN plans).
section_photos36() {
  for c in "" dynamic static; do ingest "ingest_12mp_${c:-eager}" 150 4 12mp --fused --repeats 3 ${c:+--compile $c}; done
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
# After a review of final35's code (a size met first keeps FlashAttention once, no cuDNN in graph warm-ups, an
# out-of-memory error is not a refusal): the GPU tests but the compiled ones, 12-MP photos with fused kernels.
section_check37() {
  gpu_tests 240 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "not compiled"
  ingest ingest_12mp 100 4 12mp --fused --repeats 3
  grep -H "runs:\|MFU\|utilisation\|tower attention" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
# Rerank K with a new candidate by its format and preprocessing (defaults: the official CPU path), side by side.
section_jpeg38() {
  for fmt in png jpeg jpeg-nvjpeg; do
    core "core_$fmt" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 $(case $fmt in jpeg) echo --jpeg ;;
      jpeg-nvjpeg) echo --jpeg --preprocess gpu-nvjpeg ;; esac); done
}

# Search p50 at the product's defaults (CUDA graphs on; final35's row ran the bench's eager default), one tower
# shared vs two towers (an embedding and a reranker checkpoint), and 12-MP photos.
section_search39() {
  [ -d "$CKPT-embedding" ] || [ "${DRY_RUN:-0}" = 1 ] || python3 -c "from retrieval.qwen.checkpoint import \
make_test_model as m; m('$CKPT-embedding', 'embedding', size='2b', dtype='bfloat16', seed=1)"
  search448 search_448_eager 100 5 5
  for towers in shared distinct; do
    search448 "search_448_$towers" 110 7 6 --cuda-graphs --embedding-checkpoint "$CKPT-embedding" --towers $towers
  done
  photos search_photo 110 7 24 4 --cuda-graphs
  grep -H "rubric + candidate  \|3 criteria\|stage of" "$OUT"/search_*.log | sed 's|^[^:]*/||'
}
# After review: a run's first claim is 8 in every run (the sizes a runner saw no longer carry over between runs).
section_final50() {
  ingest ingest_12mp 110 4 12mp --fused --cuda-graphs --repeats 3 --batch-size 64
  ingest ingest_448 100 4 448 --fused --cuda-graphs --repeats 2
  grep -H "runs:\|MFU\|utilisation\|batches;" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
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

source "$(dirname "$0")/gpu_sections_past.sh"  # the earlier sections (before probe29, profile40..check49, trace57..final60, final51..final56)
IFS=, read -ra wanted <<< "$section"
for name in "${wanted[@]}"; do
  "section_$name"
done
