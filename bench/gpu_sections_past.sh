# Earlier sections of bench/gpu_run.sh (sourced by it; run them through it: `bash bench/gpu_run.sh fused`), kept so
# every command the README's benchmark table cites can be run again. The steps and shared measurements they call
# (step, ingest, core, search448, photos, load, gpu_tests) are defined in gpu_run.sh.
# shellcheck shell=bash
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

# Moved from gpu_run.sh on 2026-11-26 (profile40 .. check49).
# Why search39's rerank of 20 (52.5 ms) is slower than core_reuse's K=20 with its candidate encode (32-42 ms): one
# search profiled (kernels, ops, py-spy), fused kernels on, and core_reuse's rerank without them.
section_profile40() {
  search448 search_profile 150 90 5 --cuda-graphs --profile
  search448 search_fused 100 7 6 --cuda-graphs --fused
  core core_k20 100 6 10 --cuda-graphs --only rerank --ks 20,50
  core core_k20_fused 100 6 10 --cuda-graphs --fused --only rerank --ks 20,50
}
# After profile40 (fused kernels decide search latency; they are now the default where liger-kernel is installed):
# the reranker's attention merge as one Triton kernel against --revert merge, alternating; one image x 8 instructions.
section_merge41() {
  gpu_tests 200 6 tests/test_gpu.py tests/test_gpu_tower.py -o addopts="" -k "merge or packed or rerank or flash_one"
  for r in 1 2; do for rev in "" merge; do
    core "core_${rev:-new}_$r" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 ${rev:+--revert=$rev}; done; done
  core core_embed 100 8 10 --cuda-graphs --fused --only embed
  grep -H "^20 \|^50 " "$OUT"/core_*.log | sed 's|^[^:]*/||'
}
# Search and load at the product's defaults (CUDA graphs, fused kernels auto): one tower and two, a JPEG candidate
# (nvJPEG), 12-MP photos, and issue 14's load test.
section_defaults41() {
  [ -d "$CKPT-embedding" ] || [ "${DRY_RUN:-0}" = 1 ] || python3 -c "from retrieval.qwen.checkpoint import \
make_test_model as m; m('$CKPT-embedding', 'embedding', size='2b', dtype='bfloat16', seed=1)"
  for arm in shared distinct jpeg; do
    search448 "search_448_$arm" 100 7 6 --cuda-graphs --fused --embedding-checkpoint "$CKPT-embedding" $(case $arm in
      distinct) echo --towers distinct ;; jpeg) echo --jpeg ;; esac)
  done
  photos search_photo 110 7 24 4 --cuda-graphs --fused
  FUSED=auto load load_search 200 12 200 256 1,16,64 10
  grep -H "rubric + candidate  \|3 criteria\|stage of" "$OUT"/search_*.log | sed 's|^[^:]*/||'
}
# The load test with issue 14's workload (a rubric, no criteria: one judgement per reference) at the product's defaults;
# one image x 8 instructions with a JPEG candidate; ingestion with fused kernels, now the default where liger-kernel
# is installed (the official and raw baselines of final35 ran on the same files: fused kernels would speed them up
# too, since the rotary switch is process-wide).
section_final42() {
  FUSED=auto load load_rubric 200 12 200 256 1,16,64 10 --criteria 0
  core core_embed_jpeg 100 8 10 --cuda-graphs --fused --only embed --jpeg --preprocess gpu-nvjpeg
  ingest ingest_448 100 4 448 --fused --cuda-graphs --repeats 2
  ingest ingest_mixed 100 4 mixed --fused --cuda-graphs --repeats 2
  ingest ingest_12mp 150 4 12mp --fused --cuda-graphs --repeats 3
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
# Where 64 clients wait (final42: 17.5 searches/s at 29 % GPU utilisation): py-spy stacks of the server, all threads
# and the GIL holder, during the 64-client level of issue 14's workload.
section_spy43() {
  FUSED=auto load load_spy 200 120 200 64 1,64 10 --criteria 0 --py-spy
}

# The final state: the GPU tests but the compiled ones, and jpeg38's rerank K by candidate format with the merge kernel.
section_final44() {
  gpu_tests 300 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
  section_jpeg38
  grep -H "^20 \|^50 " "$OUT"/core_*.log | sed 's|^[^:]*/||'
}
# After a review of final44's code (the merge kernel tried once per device and dtype, launched on its tensors'
# device, lerp's two-sided form; the fused kernels' "auto" check imports every name they use): GPU tests, rerank K.
section_check45() {
  gpu_tests 300 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
  core core_png 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50
}
# Issue 14's load with the GPU utilisation and busy cores of each client level; shortlists the scheduler merged run
# as one graph replay per search (the new default) vs one merged chunk (--revert split-groups), alternating.
section_load46() {
  FUSED=auto load load_split 170 7 200 256 1,16,64 10 --criteria 0
  FUSED=auto load load_merged 170 7 200 256 1,16,64 10 --criteria 0 --revert split-groups
  FUSED=auto load load_split2 170 7 200 256 1,16,64 10 --criteria 0
}
# The GPU tests of the packed shortlists (split-groups among them); 12-MP photos claimed 16 vs 8 per batch (64 photos:
# 4 or 8 batches, so the pipeline's fill and drain weigh less with 8), alternating processes of 3 timed runs.
section_check47() {
  gpu_tests 200 6 tests/test_gpu.py -o addopts="" -k "rerank or merged or packed or merge_kernel"
  for arm in b16 b8 b16b b8b; do
    ingest "ingest_12mp_$arm" 140 4 12mp --fused --cuda-graphs --repeats 3 $([[ $arm == b8* ]] && echo --batch-size 8)
  done
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
# Claims sized by RUBRICSEARCH_WORKER_BATCH_PIXELS (64 items or 100 M decoded pixels: 8 photos) at the defaults
# (--batch-size 64, CUDA's), 448 px also without the bound (--batch-pixels 0); the load A/B of load46 once more.
section_final48() {
  for arm in a b; do ingest "ingest_12mp_$arm" 110 4 12mp --fused --cuda-graphs --repeats 3 --batch-size 64; done
  ingest ingest_448 100 4 448 --fused --cuda-graphs --repeats 2
  ingest ingest_448_unbounded 100 4 448 --fused --cuda-graphs --repeats 2 --batch-pixels 0
  FUSED=auto load load_split 150 7 200 256 1,16,64 10 --criteria 0
  FUSED=auto load load_merged 150 7 200 256 1,16,64 10 --criteria 0 --revert split-groups
  ingest ingest_mixed 90 4 mixed --fused --cuda-graphs --repeats 2
  grep -H "runs:\|MFU\|utilisation\|batches;" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
# The final state of final48's code: the GPU tests but the compiled ones.
section_check49() { gpu_tests 300 8 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"; }

# Moved from gpu_run.sh on 2026-11-26 (trace57 .. final60).
# Where 448 px ingestion's GPU idles now (trace28 saw it at 198 images/s, final50 at 270 with the GPU 76 % busy),
# whether bulk CUDA graphs (opt-in) still pay at 448 px and on the mixed set (alternating processes), the passes' top
# kernels at ingestion and search batch sizes, and the device search's GPU tests (its mirror pinned to a GPU index).
section_trace57() {
  for arm in a b; do
    ingest "ingest_448_$arm" 100 2 448 --fused --cuda-graphs --repeats 3
    ingest "ingest_448_bulk_$arm" 100 2 448 --fused --cuda-graphs --bulk-graphs --repeats 3
  done
  ingest ingest_448_trace 120 70 448 --fused --cuda-graphs --torch-profile
  ingest ingest_mixed 90 2 mixed --fused --cuda-graphs --repeats 2
  ingest ingest_mixed_bulk 90 2 mixed --fused --cuda-graphs --bulk-graphs --repeats 2
  grep -H "runs:\|MFU\|utilisation\|batches;" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
  step pass_profile 120 70 python3 bench/pass_profile.py --checkpoint "$CKPT" --fused --cuda-graphs --top 12
  gpu_tests 60 4 tests/test_device_search.py -o addopts="" -k cuda
}

# After trace57 (the tower's rotary: Liger's float32 casts ~15 ms and its kernel 6.8 ms of a 110 ms pass over 64
# images of 448 px): the rotary as one Triton kernel (retrieval/qwen/rope_kernel.py) vs --revert rope, alternating
# processes, at 448 px, 12-MP photos and the mixed set; the tower's kernels after; its GPU tests first.
section_rope58() {
  gpu_tests 150 6 tests/test_gpu.py tests/test_gpu_tower.py -o addopts="" -k "rope or fused"
  step pass_profile 120 12 python3 bench/pass_profile.py --checkpoint "$CKPT" --fused --cuda-graphs --top 12
  for arm in a b; do
    ingest "ingest_448_$arm" 100 2 448 --fused --cuda-graphs --repeats 3
    ingest "ingest_448_old_$arm" 100 2 448 --fused --cuda-graphs --repeats 3 --revert rope
  done
  ingest ingest_12mp 110 2 12mp --fused --cuda-graphs --repeats 3 --batch-size 64
  ingest ingest_12mp_old 110 2 12mp --fused --cuda-graphs --repeats 3 --batch-size 64 --revert rope
  ingest ingest_mixed 90 2 mixed --fused --cuda-graphs --repeats 2
  ingest ingest_mixed_old 90 2 mixed --fused --cuda-graphs --repeats 2 --revert rope
  grep -H "runs:\|MFU\|utilisation\|batches;" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}

# The final state: the GPU tests but the compiled ones; rope58's 12-MP A/B once more, the revert's process first; the
# rerank of 50 with a new candidate and search p50 at the defaults (the candidate's tower takes the kernel too).
section_final59() {
  gpu_tests 200 6 tests/test_gpu_tower.py tests/test_gpu.py tests/test_device_search.py -o addopts="" -k "not compiled"
  ingest ingest_12mp_old_b 110 2 12mp --fused --cuda-graphs --repeats 3 --batch-size 64 --revert rope
  ingest ingest_12mp_b 110 2 12mp --fused --cuda-graphs --repeats 3 --batch-size 64
  grep -H "runs:\|MFU\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
  core core_k50 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 --query-tier
  search448 search_448 100 7 6 --cuda-graphs --fused
}

# After review of the rotary kernel (int64 offsets, no autograd, a bit-exact trial on a GPU): its GPU tests through the
# fused model's function, then rerank K with a new candidate vs --revert rope, alternating (final59 had no baseline).
section_final60() {
  gpu_tests 100 4 tests/test_gpu.py -o addopts="" -k rope
  for arm in new old; do
    core "core_$arm" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 --query-tier $([ $arm = old ] && echo --revert rope)
  done
}

# Moved from gpu_run.sh on 2026-11-26 (final51 .. final56).
# Rerank K with a new candidate whose package goes where the server puts it (the query tier) vs into the package
# store's memory tier (the bench's store has no directory; as core_reuse did before), alternating; then nvJPEG.
section_final51() {
  for arm in tier store tier2 store2; do
    core "core_$arm" 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 $([[ $arm == tier* ]] && echo --query-tier)
  done
  core core_tier_nvjpeg 100 4 10 --cuda-graphs --fused --only rerank --ks 20,50 --query-tier --jpeg --preprocess gpu-nvjpeg
  grep -H "^20 \|^50 " "$OUT"/core_*.log | sed 's|^[^:]*/||'
}
# Where 64 clients wait now that merged shortlists replay a graph each (spy43's question again, after final48).
section_spy52() { FUSED=auto load load_spy 200 120 200 64 1,64 10 --criteria 0 --py-spy; }
# spy52 found 64 clients' searches waiting 23 % of their time for a set's lock, held by one search while its
# read-back waited behind the models' queued passes: the device search on a stream of its own vs --revert ann-stream.
section_load53() {
  gpu_tests 150 4 tests/test_device_search.py tests/test_gpu.py -o addopts="" -k "cuda or merged"
  FUSED=auto load load_stream 150 7 200 256 1,16,64 10 --criteria 0
  FUSED=auto load load_shared 150 7 200 256 1,16,64 10 --criteria 0 --revert ann-stream
  FUSED=auto load load_stream2 150 7 200 256 1,16,64 10 --criteria 0
}
# The final state: the GPU tests but the compiled ones (the device search's stream test warmed up first).
section_check54() {
  gpu_tests 300 8 tests/test_device_search.py tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"
}
# After review: the mirrors' streams from the priority -2 pool (GPU preprocessing shares -1's under turns): the
# device search's GPU tests, then issue 14's load once more.
section_check55() {
  gpu_tests 120 6 tests/test_device_search.py -o addopts=""
  FUSED=auto load load_final 150 7 200 256 1,16,64 10 --criteria 0
}
# The final state's single-search numbers beside the device search's side stream: ANN at 1M x 2048 and search p50
# (rubric + PNG / JPEG candidate) at the defaults, as defaults41 measured them.
section_final56() {
  step ann_gpu 90 4 python3 bench/ann_recall.py --device-search torch --sizes 1m --dim 2048 --data lowrank --queries 200
  for arm in shared jpeg; do
    search448 "search_448_$arm" 100 7 6 --cuda-graphs --fused $([ $arm = jpeg ] && echo --jpeg)
  done
}
