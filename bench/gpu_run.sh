#!/usr/bin/env bash
# One device call measures everything: `bash bench/gpu_run.sh [probe,tower,ingest,search|all]` (default all).
#   probe  — what the box offers for decode/resize/attention (bench/gpu_probe.py)
#   tower  — the tower and LM pass micro-benchmarks with a profile (bench/ingest_throughput.py --probe)
#   ingest — GPU tests, then ingestion at 448 px square, the mixed <= 640 px set and 12-MP photos
#   graphs — CUDA-graph LM passes vs eager; fast_search — search, photos, load test with graphs + fused kernels
#   fused, fused_search — Liger's fused kernels vs the reference ones: GPU tests, passes, ingestion, search
#   compile — GPU tests (eager + compiled), compiled vs eager passes, ingestion eager vs torch.compile; photos — 12-MP ingestion; compiled_search — core reuse compiled
#   report — issue 12's side-by-side ingestion report (ours / official / raw / FLOP limit) + the load test
#   search — ANN on the GPU at 1M x 2048, core reuse (1 image x 8 instructions, rerank K), search latency
#            against a 1M-reference index (448 px and 12-MP photos), and the load test (1..64 clients)
# Each step runs under its own time limit, samples GPU utilisation, and logs to $OUT/<step>.log; the last
# lines of every step are printed. Carry .whl (transformers >= 5.19 and the project's pure-Python deps).
set -uo pipefail
section=${1:-all}
[ "$section" = all ] && section=probe,tower,ingest,compile,search,compiled_search
OUT=${OUT:-/tmp/rs-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, torchvision; print('torch', torch.__version__, 'torchvision', \
torchvision.__version__, 'transformers', transformers.__version__, 'cpus', __import__('os').cpu_count())"

CKPT=/tmp/rs-2b
if [ ! -d "$CKPT" ]; then
  python3 -c "from retrieval.qwen.checkpoint import make_test_model as m; m('$CKPT', 'reranker', size='2b', dtype='bfloat16')"
fi

# step NAME SECONDS TAIL CMD...: run with a limit, GPU utilisation sampled every 100 ms, log kept
step() {
  local name=$1 limit=$2 tail_n=$3
  shift 3
  echo "===== $name ($(date +%H:%M:%S), limit ${limit}s)"
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > "$OUT/util_$name.txt" 2>/dev/null &
  local sampler=$!
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  kill $sampler 2>/dev/null
  tail -n "$tail_n" "$OUT/$name.log"
  awk -v n="$name" '{s+=$1; c++} END {if (c) printf "[%s] rc=%s, mean GPU utilisation %.0f%% over %.1f s\n", n, "'$rc'", s/c, c/10}' \
    "$OUT/util_$name.txt"
}

section_probe() {
  step gpu_probe 60 20 python3 bench/gpu_probe.py
}
section_tower() {
  step tower_probe 150 25 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 --probe
}
section_ingest() {
  step gpu_tests 120 6 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts=""
  for pre in official gpu-nvjpeg; do
    step "ingest_448_$pre" 75 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
      --square --images 512 --preprocess "$pre"
  done
  step ingest_mixed 75 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 640 \
    --images 512 --preprocess gpu-nvjpeg
  step ingest_12mp 90 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg
  step preprocess_dev 90 8 python3 bench/gpu_preprocess_deviation.py --checkpoint "$CKPT" --device cuda --photos 12
  step fp8_packages 60 5 python3 bench/fp8_packages.py --checkpoint "$CKPT" --device cuda --images 24
}
section_compile() {
  step gpu_tests 200 6 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts=""
  step compile_check 120 6 python3 bench/compile_check.py --checkpoint "$CKPT" --device cuda --images 64
  for shape in "448 --square" "640"; do
    set -- $shape
    step "ingest_$1_eager" 50 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side "$@" \
      --images 512 --preprocess gpu-nvjpeg
    step "ingest_$1_compiled" 130 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" \
      --side "$@" --images 512 --preprocess gpu-nvjpeg --compile dynamic
  done
}
section_search() {
  step core_reuse 90 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6
  step search_448 100 9 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg
  step search_photo 90 9 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 32 --repeats 5 --preprocess gpu-nvjpeg
  step load_search 140 9 python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --ingest-during 256 --clients 1,4,16,64 --seconds 12 --preprocess gpu-nvjpeg
  step ann_gpu 90 4 python3 bench/ann_recall.py --device-search torch --sizes 1m --dim 2048 --data lowrank \
    --queries 200
}
# Liger's fused kernels (RUBRICSEARCH_FUSED_KERNELS) vs the reference kernels, side by side; two calls.
section_fused() {
  step gpu_tests 200 6 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts=""
  step fused_check 120 8 python3 bench/fused_check.py --checkpoint "$CKPT" --images 64 --rerank 20
  for shape in "448 --square" "640"; do
    set -- $shape
    for mode in reference fused; do
      step "ingest_$1_$mode" 60 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" \
        --side "$@" --images 512 --preprocess gpu-nvjpeg $([ $mode = fused ] && echo --fused)
    done
  done
}
section_fused_search() {
  step fused_check 120 8 python3 bench/fused_check.py --checkpoint "$CKPT" --images 64 --rerank 20
  for mode in reference fused; do
    flag=$([ $mode = fused ] && echo --fused)
    step "search_448_$mode" 100 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" \
      --side 448 --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg $flag
    step "ingest_12mp_$mode" 80 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" \
      --side 4032 --images 64 --batch-size 16 --preprocess gpu-nvjpeg $flag
  done
}
# Small LM passes as CUDA graphs (RUBRICSEARCH_CUDA_GRAPHS) vs eager, side by side (with fused kernels too).
section_graphs() {
  step gpu_tests 200 6 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts="" -k "graph or eager"
  for flags in "" "--cuda-graphs" "--cuda-graphs --fused"; do
    step "pass_profile${flags// /_}" 120 30 python3 bench/pass_profile.py --checkpoint "$CKPT" $flags --top 6
  done
  for flags in "" "--cuda-graphs --fused"; do
    step "search_448${flags// /_}" 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" \
      --side 448 --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg $flags
  done
  step core_reuse_graphs 90 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6 --cuda-graphs
}
# Search with both speed settings on (CUDA graphs are on by default; fused kernels opt-in): latency, photos,
# core reuse and the load test, after the full GPU test suite.
section_fast_search() {
  step gpu_tests 200 6 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts=""
  step search_448 100 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused
  step search_photo 90 9 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
  step core_reuse 90 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6 --cuda-graphs
  step load_search 150 10 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b --checkpoint "$CKPT" \
    --side 448 --references 200 --ingest-during 256 --clients 1,4,16,64 --seconds 10 --preprocess gpu-nvjpeg
}
section_load() {
  for fused in false true; do
    step "load_search_fused_$fused" 170 10 env RUBRICSEARCH_FUSED_KERNELS=$fused python3 bench/load_search.py --size 2b \
      --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 --clients 1,4,16,64 --seconds 10 \
      --preprocess gpu-nvjpeg
  done
}
section_graphs2() {
  step gpu_tests 200 8 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts=""
  for flags in "" "--cuda-graphs --fused"; do
    step "search_448${flags// /_}" 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" \
      --side 448 --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg $flags
  done
  search_tail
}
# Photos, core reuse and the load test, all with CUDA graphs and fused kernels (graphs2, verify).
search_tail() {
  step search_photo 90 9 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
  step core_reuse 90 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6 --cuda-graphs
  step load_search 150 10 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b \
    --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 --clients 1,4,16,64 --seconds 10 \
    --preprocess gpu-nvjpeg
}
# Issue 14's profile: where one warm search and a loaded server spend their time (graphs + fused kernels).
section_profile14() {
  step search_profile 170 75 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 5 --preprocess gpu-nvjpeg --cuda-graphs --fused --profile
  step rerank_profile 90 40 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 3 --only rerank \
    --ks 20,50 --profile --cuda-graphs
  step load_profile 170 80 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b \
    --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 128 --clients 1,64 --seconds 12 \
    --preprocess gpu-nvjpeg --py-spy
}
# Packed shortlist passes (FlashAttention varlen, rerank/packed_prefix.py) vs the padded ones, side by side.
section_packed() {
  step gpu_tests 200 10 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts="" -s \
    -k "rerank or packed or graph or shared"
  for flags in "--padded" ""; do
    step "search_448${flags// /_}" 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" \
      --side 448 --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused $flags
  done
  step search_photo 100 11 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
}
# After packed passes and tower graphs: GPU tests, search (448 px, photos), core reuse and the load test.
section_verify() {
  step gpu_tests 240 12 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tower.py tests/test_gpu.py \
    -o addopts="" -s -k "packed or graph or tower or rerank"
  step search_448 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused
  search_tail
}
# Issue 12's ingestion workloads with fused kernels (packed LM passes on): 448 px, mixed, 12-MP photos.
section_ingest2() {
  step ingest_448 100 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
    --square --images 512 --preprocess gpu-nvjpeg --fused --baselines
  step ingest_mixed 100 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 640 \
    --images 512 --preprocess gpu-nvjpeg --fused --baselines
  step ingest_12mp 130 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg --fused --baselines
}
section_load_ingest() {
  step load_search 150 16 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b \
    --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 --clients 1,16,64 --seconds 10 \
    --preprocess gpu-nvjpeg
  step ingest_448 100 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
    --square --images 512 --preprocess gpu-nvjpeg --fused --baselines
  step ingest_12mp 130 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg --fused --baselines
}
# The load test with CUDA graphs off and on (packed passes either way), side by side.
section_load_graphs() {
  for graphs in ${GRAPHS:-false true}; do
    step "load_graphs_$graphs" 120 12 env RUBRICSEARCH_FUSED_KERNELS=true RUBRICSEARCH_CUDA_GRAPHS=$graphs \
      python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 \
      --clients ${CLIENTS:-1,64} --seconds 10 --preprocess gpu-nvjpeg
  done
}
# The final search numbers: GPU tests, 448 px JPEG and noise-PNG candidates, photos, core reuse, load.
section_verify2() {
  step gpu_tests 240 12 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tower.py tests/test_gpu.py \
    -o addopts="" -s -k "packed or graph or tower or rerank"
  for fmt in --jpeg ""; do
    step "search_448$fmt" 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" \
      --side 448 --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused $fmt
  done
  step search_photo 90 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
  step core_reuse 80 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6 --cuda-graphs --fused
  step load_search 150 12 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b \
    --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 --clients 1,16,64 --seconds 10 \
    --preprocess gpu-nvjpeg
}
# The last check of the session: GPU tests, 448 px JPEG search, photos, core reuse (fused), load.
section_verify3() {
  step gpu_tests 200 12 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu_tower.py tests/test_gpu.py \
    -o addopts="" -s -k "packed or graph or tower or rerank"
  step search_448 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused --jpeg
  step search_photo 90 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
  step core_reuse 150 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 4 --cuda-graphs --fused \
    --ks 20,50
  step load_search 120 12 env RUBRICSEARCH_FUSED_KERNELS=true python3 bench/load_search.py --size 2b \
    --checkpoint "$CKPT" --side 448 --references 200 --ingest-during 256 --clients 1,64 --seconds 10 \
    --preprocess gpu-nvjpeg
}
# Chunk graphs (a shortlist's prefix and all its packs in one replay): tests, search, photos, rerank K.
section_verify4() {
  step gpu_tests 150 8 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts="" -s \
    -k "packed or rerank"
  step search_448 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused --jpeg
  step core_reuse 90 8 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 4 --cuda-graphs --fused \
    --only rerank --ks 20,50
  step search_photo 90 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg --cuda-graphs --fused
}
# After the review mends (a chunk's packs share one prefix pack): the rerank GPU tests and the 448 px search.
section_recheck() {
  step gpu_tests 150 8 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts="" -s \
    -k "packed or rerank"
  step search_448 100 14 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg --cuda-graphs --fused --jpeg
}
section_compiled_search() {
  step core_reuse_compiled 150 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6 --compile
}
section_iterate() {
  step load_search 140 9 python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --ingest-during 256 --clients 1,4,16,64 --seconds 12 --preprocess gpu-nvjpeg
  step search_448 110 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg
  step rerank_profile 70 40 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 3 --only rerank \
    --ks 50 --profile
  step ingest_12mp 90 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg
  step ingest_448 60 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
    --square --images 512 --preprocess gpu-nvjpeg
}

section_final() {
  step search_448 100 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg
  step load_search 150 10 python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 \
    --references 200 --ingest-during 256 --clients 1,4,16,64 --seconds 10 --preprocess gpu-nvjpeg
  step core_reuse 80 16 python3 bench/core_reuse.py --mode gpu --checkpoint "$CKPT" --repeats 6
  step search_photo 70 9 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --photo \
    --references 24 --repeats 4 --preprocess gpu-nvjpeg
  step ingest_448 45 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
    --square --images 512 --preprocess gpu-nvjpeg
  step ingest_mixed 45 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 640 \
    --images 512 --preprocess gpu-nvjpeg
  step ingest_12mp 50 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg
}

# The ingestion report of issue 12: each workload side by side with the official class path, the raw
# transformers pieces and the FLOP limit (--baselines), then the load test. Fits one 10-minute call.
section_report() {
  step ingest_448 120 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 448 \
    --square --images 512 --preprocess gpu-nvjpeg --baselines
  step ingest_mixed 120 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 640 \
    --images 512 --preprocess gpu-nvjpeg --baselines
  step ingest_12mp 150 26 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg --baselines
  step load_search 170 10 python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 \
    --references 200 --ingest-during 256 --clients 1,4,16,64 --seconds 10 --preprocess gpu-nvjpeg
  step search_448 100 12 python3 bench/search_latency.py --device cuda --size 2b --checkpoint "$CKPT" --side 448 \
    --references 400 --index-size 1000000 --repeats 6 --preprocess gpu-nvjpeg
}

# Where a loaded server spends its time: the load test with py-spy stack samples at 64 clients.
section_loadprofile() {
  step load_profile 150 80 python3 bench/load_search.py --size 2b --checkpoint "$CKPT" --side 448 \
    --references 200 --ingest-during 128 --clients 1,64 --seconds 12 --preprocess gpu-nvjpeg --py-spy
}

section_photos() {
  step ingest_12mp 90 21 python3 bench/ingest_throughput.py --device cuda --checkpoint "$CKPT" --side 4032 \
    --images 64 --batch-size 16 --preprocess gpu-nvjpeg
}

IFS=, read -ra wanted <<< "$section"
for name in "${wanted[@]}"; do
  "section_$name"
done
