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
# search448 NAME LIMIT TAIL REPEATS [FLAGS]: search p50 with 448 px candidates against a 1M-reference index.
search448() {
  local n=$1 l=$2 t=$3 r=$4; shift 4
  step "$n" "$l" "$t" python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats "$r" --preprocess gpu-nvjpeg "$@"
}
# photos NAME LIMIT TAIL REFERENCES REPEATS [FLAGS]: search p50 with a 12-MP candidate against 12-MP references.
photos() {
  local n=$1 l=$2 t=$3 refs=$4 r=$5; shift 5
  step "$n" "$l" "$t" python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references "$refs" --repeats "$r" --preprocess gpu-nvjpeg "$@"
}
# core NAME LIMIT TAIL REPEATS [FLAGS]: 1 image x 8 instructions and rerank K (bench/core_reuse.py).
core() { local n=$1 l=$2 t=$3 r=$4; shift 4; step "$n" "$l" "$t" python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats "$r" "$@"; }
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
# load NAME LIMIT TAIL REFERENCES INGEST CLIENTS SECONDS [FLAGS]: the load test. FUSED=true|false before the call
# sets RUBRICSEARCH_FUSED_KERNELS for the server, GRAPHS_ENV=true|false RUBRICSEARCH_CUDA_GRAPHS.
load() {
  local n=$1 l=$2 t=$3 refs=$4 during=$5 clients=$6 seconds=$7; shift 7
  local settings=(${FUSED:+RUBRICSEARCH_FUSED_KERNELS=$FUSED} ${GRAPHS_ENV:+RUBRICSEARCH_CUDA_GRAPHS=$GRAPHS_ENV})
  step "$n" "$l" "$t" ${settings[@]:+env "${settings[@]}"} python3 bench/load_search.py --size 2b --checkpoint "$CKPT" \
    --side 448 --references "$refs" --ingest-during "$during" --clients "$clients" --seconds "$seconds" \
    --preprocess gpu-nvjpeg "$@"
}

section_probe() {
  step gpu_probe 60 20 python3 bench/gpu_probe.py
}
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
# Liger's fused kernels (RUBRICSEARCH_FUSED_KERNELS) vs the reference kernels, side by side; two calls.
section_fused() {
  gpu_tests 200 6 tests/test_gpu.py -o addopts=""
  step fused_check 120 8 python3 bench/fused_check.py --checkpoint "$CKPT" --images 64 --rerank 20
  for shape in 448 mixed; do
    name=${shape/mixed/640}
    for mode in reference fused; do
      ingest "ingest_${name}_$mode" 60 21 $shape $([ $mode = fused ] && echo --fused)
    done
  done
}
section_fused_search() {
  step fused_check 120 8 python3 bench/fused_check.py --checkpoint "$CKPT" --images 64 --rerank 20
  for mode in reference fused; do
    flag=$([ $mode = fused ] && echo --fused)
    search448 "search_448_$mode" 100 12 6 $flag
    ingest "ingest_12mp_$mode" 80 21 12mp $flag
  done
}
# Small LM passes as CUDA graphs (RUBRICSEARCH_CUDA_GRAPHS) vs eager, side by side (with fused kernels too).
section_graphs() {
  gpu_tests 200 6 tests/test_gpu.py -o addopts="" -k "graph or eager"
  for flags in "" "--cuda-graphs" "--cuda-graphs --fused"; do
    step "pass_profile${flags// /_}" 120 30 python3 bench/pass_profile.py --checkpoint "$CKPT" $flags --top 6
  done
  for flags in "" "--cuda-graphs --fused"; do
    search448 "search_448${flags// /_}" 100 14 6 $flags
  done
  core core_reuse_graphs 90 16 6 --cuda-graphs
}
# Search with both speed settings on (CUDA graphs are on by default; fused kernels opt-in): latency, photos,
# core reuse and the load test, after the full GPU test suite.
section_fast_search() {
  gpu_tests 200 6 tests/test_gpu.py -o addopts=""
  search448 search_448 100 12 6 --cuda-graphs --fused
  photos search_photo 90 9 24 4 --cuda-graphs --fused
  core core_reuse 90 16 6 --cuda-graphs
  FUSED=true load load_search 150 10 200 256 1,4,16,64 10
}
section_load() {
  for fused in false true; do
    FUSED=$fused load "load_search_fused_$fused" 170 10 200 256 1,4,16,64 10
  done
}
section_graphs2() {
  gpu_tests 200 8 tests/test_gpu.py -o addopts=""
  for flags in "" "--cuda-graphs --fused"; do
    search448 "search_448${flags// /_}" 100 14 6 $flags
  done
  search_tail
}
# Photos, core reuse and the load test, all with CUDA graphs and fused kernels (graphs2, verify).
search_tail() {
  photos search_photo 90 9 24 4 --cuda-graphs --fused
  core core_reuse 90 16 6 --cuda-graphs
  FUSED=true load load_search 150 10 200 256 1,4,16,64 10
}
# Issue 14's profile: where one warm search and a loaded server spend their time (graphs + fused kernels).
section_profile14() {
  search448 search_profile 170 75 5 --cuda-graphs --fused --profile
  core rerank_profile 90 40 3 --only rerank --ks 20,50 --profile --cuda-graphs
  FUSED=true load load_profile 170 80 200 128 1,64 12 --py-spy
}
# Packed shortlist passes (FlashAttention varlen, rerank/packed_prefix.py) vs the padded ones, side by side.
section_packed() {
  gpu_tests 200 10 tests/test_gpu.py -o addopts="" -s -k "rerank or packed or graph or shared"
  for flags in "--padded" ""; do
    search448 "search_448${flags// /_}" 100 14 6 --cuda-graphs --fused $flags
  done
  photos search_photo 100 11 24 4 --cuda-graphs --fused
}
# After packed passes and tower graphs: GPU tests, search (448 px, photos), core reuse and the load test.
section_verify() {
  gpu_tests 240 12 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "packed or graph or tower or rerank"
  search448 search_448 100 14 6 --cuda-graphs --fused
  search_tail
}
section_load_ingest() {
  FUSED=true load load_search 150 16 200 256 1,16,64 10
  ingest ingest_448 100 26 448 --fused --baselines
  ingest ingest_12mp 130 26 12mp --fused --baselines
}
# The load test with CUDA graphs off and on (packed passes either way), side by side.
section_load_graphs() {
  for graphs in ${GRAPHS:-false true}; do
    GRAPHS_ENV=$graphs FUSED=true load "load_graphs_$graphs" 120 12 200 256 "${CLIENTS:-1,64}" 10
  done
}
# The final search numbers: GPU tests, 448 px JPEG and noise-PNG candidates, photos, core reuse, load.
section_verify2() {
  gpu_tests 240 12 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "packed or graph or tower or rerank"
  for fmt in --jpeg ""; do
    search448 "search_448$fmt" 100 14 6 --cuda-graphs --fused $fmt
  done
  photos search_photo 90 12 24 4 --cuda-graphs --fused
  core core_reuse 80 16 6 --cuda-graphs --fused
  FUSED=true load load_search 150 12 200 256 1,16,64 10
}
# The last check of the session: GPU tests, 448 px JPEG search, photos, core reuse (fused), load.
section_verify3() {
  gpu_tests 200 12 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -s -k "packed or graph or tower or rerank"
  search448 search_448 100 14 6 --cuda-graphs --fused --jpeg
  photos search_photo 90 12 24 4 --cuda-graphs --fused
  core core_reuse 150 16 4 --cuda-graphs --fused --ks 20,50
  FUSED=true load load_search 120 12 200 256 1,64 10
}
# Chunk graphs (a shortlist's prefix and all its packs in one replay): tests, search, photos, rerank K.
section_verify4() {
  gpu_tests 150 8 tests/test_gpu.py -o addopts="" -s -k "packed or rerank"
  search448 search_448 100 14 6 --cuda-graphs --fused --jpeg
  core core_reuse 90 8 4 --cuda-graphs --fused --only rerank --ks 20,50
  photos search_photo 90 12 24 4 --cuda-graphs --fused
}
section_compiled_search() {
  core core_reuse_compiled 150 16 6 --compile
}

# The ingestion report of issue 12: each workload side by side with the official class path, the raw
# transformers pieces and the FLOP limit (--baselines), then the load test. Fits one 10-minute call.
section_report() {
  ingest ingest_448 120 26 448 --baselines
  ingest ingest_mixed 120 26 mixed --baselines
  ingest ingest_12mp 150 26 12mp --baselines
  load load_search 170 10 200 256 1,4,16,64 10
  search448 search_448 100 12 6
}

# The float8 device copy vs float16 at 1M x 2048 (side by side), the rerank and device-search GPU tests, where an
# ingestion batch's tower and LM passes spend GPU time (kernels), 1 image x 8 instructions with a JPEG, ingestion.
section_probe26() {
  gpu_tests 150 8 tests/test_gpu.py tests/test_device_search.py -o addopts="" -k "packed or rerank or float8"
  step ann_gpu 150 6 python3 bench/ann_recall.py --device-search torch --sizes 1m --dim 2048 --data lowrank \
    --queries 200 --precision float16,float8
  step pass_profile 120 40 python3 bench/pass_profile.py --checkpoint "$CKPT" --fused --cuda-graphs --top 25
  core core_reuse_jpeg 120 16 6 --only embed --jpeg --preprocess gpu-nvjpeg --cuda-graphs --fused
  ingest ingest_448 90 26 448 --fused
}

# The last report: bulk graphs opt-in and limited to images <= 512 x 512 px (12-MP photos stay eager).
section_final26b() {
  gpu_tests 150 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" \
    -k "bulk or (graphed and not compiled) or graph_passes or fused"
  ingest ingest_448_eager 90 26 448 --fused
  ingest ingest_448_bulk 150 44 448 --fused --cuda-graphs --bulk-graphs --baselines
  ingest ingest_12mp_bulk 150 26 12mp --fused --cuda-graphs --bulk-graphs
  ingest ingest_mixed_bulk 150 26 mixed --fused --cuda-graphs --bulk-graphs
}

# The LM pass on its own thread (encode | embed) and the catalog commit on its own (store | commit) against
# both on one thread each (--revert split,commit), alternating; then the GIL switch interval at 0.5 ms (5 by default).
section_split28() {
  local old=--revert=split,commit
  gpu_tests 150 4 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled and not 2b"
  for r in 1 2; do
    ingest ingest_448_split_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3
    ingest ingest_448_before_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 $old
    ingest ingest_448_gil_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --switch-interval 0.0005
  done
  grep -A22 "^ingest:" "$OUT"/ingest_448_split_2.log
  grep -H "runs:\|^ingest:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Where the vision and LM threads wait after split28 (sync debug, py-spy), then photos and mixed split vs before.
section_where28() {
  local old=--revert=split,commit
  ingest ingest_448_syncs 100 20 448 --fused --cuda-graphs --bulk-graphs --sync-debug
  ingest ingest_448_spy 120 75 448 --fused --cuda-graphs --bulk-graphs --images 1024 --py-spy 4
  ingest ingest_12mp 150 2 12mp --fused --repeats 2
  ingest ingest_12mp_before 150 2 12mp --fused --repeats 2 $old
  ingest ingest_mixed 120 2 mixed --fused --repeats 2
  ingest ingest_mixed_before 120 2 mixed --fused --repeats 2 $old
  grep -H "runs:\|^ingest:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# The final state of split28 (GPU tests), and where each thread's time goes in it (torch.profiler, every thread).
section_trace28() {
  gpu_tests 150 4 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled and not 2b"
  ingest ingest_448_trace 200 90 448 --fused --cuda-graphs --bulk-graphs --images 256 --torch-profile
}

# After trace28: the LM's vectors read back through pinned memory and an event against .cpu() (--revert
# download), alternating. Run it in a call of its own: its log names are split28's.
section_dl28() {
  gpu_tests 100 4 tests/test_gpu_tower.py -o addopts="" -k "download or packed_on_the_gpu or write_behind"
  for r in 1 2; do
    ingest ingest_448_dl_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3
    ingest ingest_448_before_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --revert download
  done
  grep -A22 "^ingest:" "$OUT"/ingest_448_dl_2.log
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# Where the tower thread's wall time goes (timers around the pipeline's functions) and how late a thread that
# sleeps 1 ms wakes (its wait for the GIL), with the default threads and with fewer (2 loaders, 1 package
# writer, 2 preprocessing threads); then py-spy of the ingestion alone (the upload staging left out).
section_probe29() {
  gpu_tests 150 4 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled and not 2b"
  ingest ingest_448_probes 100 3 448 --fused --cuda-graphs --bulk-graphs --host-probes
  ingest ingest_448_lean 100 3 448 --fused --cuda-graphs --bulk-graphs --host-probes --loaders 2 --writer-threads 1 \
    --preprocess-threads 2
  ingest ingest_448_spy 120 3 448 --fused --cuda-graphs --bulk-graphs --images 1024 --py-spy 4
  grep -h -A40 "GIL probe" "$OUT"/ingest_448_probes.log "$OUT"/ingest_448_lean.log
  grep -H "^ingest:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
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
  for r in 1 2; do
    ingest ingest_448_w4_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --writer-threads 4
    ingest ingest_448_w8_$r 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --writer-threads 8
  done
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
  for r in 1 2; do
    for dir in /tmp /dev/shm; do
      TMPDIR=$dir ingest "ingest_448${dir//\//_}_$r" 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3
    done
  done
  grep -H "runs:\|utilisation\|  store  \|  sync  " "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# After disk30: the sync on a thread of its own, a batch's files shared among the writers, against the revert.
section_ab31() { after_before --revert=sync,fanout; }

# ab31 at 2048 images (seven stage threads fill and drain in ~0.5 s), then rerank K and issue 14's load test.
section_steady31() {
  for r in 1 2; do
    ingest ingest_448_2048_new_$r 120 2 448 --fused --cuda-graphs --bulk-graphs --images 2048
    ingest ingest_448_2048_before_$r 120 2 448 --fused --cuda-graphs --bulk-graphs --images 2048 --revert=sync,fanout
  done
  core core_reuse 120 10 4 --cuda-graphs --fused --only rerank --ks 20,50
  FUSED=true load load_search 150 12 200 256 1,16,64 10
  grep -H "runs:\|^ingest:\|MFU\|utilisation\|  embed  \|  sync  " "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

section_photos() {
  ingest ingest_12mp 90 21 12mp
}

IFS=, read -ra wanted <<< "$section"
for name in "${wanted[@]}"; do
  "section_$name"
done
