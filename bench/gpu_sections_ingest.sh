# Sections of bench/gpu_run.sh from the ingestion-speed rounds (ab29 to final50; sourced by it, run them through it:
# `bash bench/gpu_run.sh ab31`), kept so every command the README's benchmark table cites can be run again. The steps
# and shared measurements they call (step, ingest, core, search448, photos, load, gpu_tests) are defined in gpu_run.sh.
# shellcheck shell=bash
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
