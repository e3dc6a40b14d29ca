# Sections of bench/gpu_run.sh from the 2026-11-26 round on where the GPU idles during ingestion (report78 to
# check87; sourced by it, run them through it: `bash bench/gpu_run.sh idle83`). depth81 and claim84 measured knobs
# that did not land: they are in this file as of commit 3159022 (README). The steps and shared measurements they
# call (step, ingest, gpu_tests) are defined in gpu_run.sh.
# shellcheck shell=bash
# Issue 12's report again (as report75) after the bench's warm-up took the timed run's image sizes (a mixed set's bulk
# graphs used to be captured inside its timed run), 3 timed runs at 448 px and mixed, 2 of photos.
section_report78() {
  local json=(--json /tmp/rs-ingest.json)
  ingest ingest_448 130 26 448 --fused --cuda-graphs --bulk-graphs --baselines --repeats 3 "${json[@]}"
  ingest ingest_mixed 140 26 mixed --fused --cuda-graphs --bulk-graphs --baselines --repeats 3 "${json[@]}"
  ingest ingest_12mp 210 26 12mp --fused --cuda-graphs --bulk-graphs --batch-size 64 --baselines --repeats 2 "${json[@]}"
}

# Where report78's 512-image runs leave the GPU idle (68 % busy at 448 px and mixed): the steady (third) run under
# torch.profiler, idle time per tenth of the run (filling and draining the pipeline vs steady), and what each
# thread ran during the gaps.
section_idle79() {
  local json=(--json /tmp/rs-ingest.json)
  ingest ingest_448_trace 150 60 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --torch-profile "${json[@]}"
  ingest ingest_mixed_trace 150 60 mixed --fused --cuda-graphs --bulk-graphs --repeats 3 --torch-profile "${json[@]}"
}

# idle79 found the mixed set's GPU idle only while the pipeline fills and drains, but 448 px idle all through its
# steady run: the 448 px trace again, now with the stage each thread was in during the gaps; and nvJPEG vs PIL
# decoding (on 8 CPU threads, resize on the GPU) at 448 px, same box.
section_idle80() {
  local json=(--json /tmp/rs-ingest.json) flags=(--fused --cuda-graphs --bulk-graphs --repeats 3)
  ingest ingest_448_trace 150 40 448 "${flags[@]}" --torch-profile "${json[@]}"
  ingest ingest_448_pil 110 3 448 "${flags[@]}" --preprocess official "${json[@]}"
  ingest ingest_448_nvjpeg 110 3 448 "${flags[@]}" "${json[@]}"
  grep -H "runs:\|utilisation" "$OUT"/ingest_448_*.log | sed 's|^[^:]*/||'
}

# The 448 px trace once more with the claims and every queue wait as ranges too (what each thread waited for during
# the GPU's gaps); claims of 128 vs 64 images at 448 px.
section_idle82() {
  local json=(--json /tmp/rs-ingest.json) flags=(--fused --cuda-graphs --bulk-graphs --repeats 3)
  ingest ingest_448_trace 150 40 448 "${flags[@]}" --torch-profile "${json[@]}"
  ingest ingest_448_b64 90 3 448 "${flags[@]}" "${json[@]}"
  ingest ingest_448_b128 90 3 448 "${flags[@]}" --batch-size 128 "${json[@]}"
  grep -H "runs:\|utilisation" "$OUT"/ingest_448_*.log | sed 's|^[^:]*/||'
}

# idle82: in the gaps the encode loop sat in its vision stage 257 of 559 ms with 14 ms of CUDA calls in the whole run:
# wall time per function and thread (the preprocessing's nvJPEG decode, the tower pass) and the GIL probe at 448 px.
section_idle83() {
  ingest ingest_448_probes 120 60 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --host-probes \
    --json /tmp/rs-ingest.json
}

# claim84 found no gain in claiming ahead: the 448 px steady run's timeline (every thread's stages and the GPU's gaps
# >= 1 ms in time order) to read its critical path batch by batch.
section_idle85() {
  ingest ingest_448_timeline 150 5 448 --fused --cuda-graphs --bulk-graphs --repeats 3 --torch-profile \
    --json /tmp/rs-ingest.json
}

# idle85's timeline: the towers' thread sat in its vision stage until a sync or catalog commit ended. That stage
# looks every new image up in the package store, under the lock the package writers hold while they rename a file
# into place (a rename may wait for the journal commit a concurrent syncfs forces). The writers renaming outside
# the lock (--unlocked-rename, an experiment: bench/rename_probe.py) vs the product, alternating, then the lookups'
# and syncs' wall time per thread.
section_rename86() {
  local json=(--json /tmp/rs-ingest.json) flags=(--fused --cuda-graphs --bulk-graphs --repeats 3)
  ingest ingest_448_locked 80 1 448 "${flags[@]}" "${json[@]}"
  ingest ingest_448_unlocked 80 1 448 "${flags[@]}" --unlocked-rename "${json[@]}"
  ingest ingest_448_locked2 80 1 448 "${flags[@]}" "${json[@]}"
  ingest ingest_448_unlocked2 80 1 448 "${flags[@]}" --unlocked-rename "${json[@]}"
  ingest ingest_448_probes 100 1 448 "${flags[@]}" --host-probes "${json[@]}"
  grep -H "runs:\|utilisation" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
  grep -h "GIL\|_lookup\|PackageStore.sync\|BatchProcessor\|_claim" "$OUT"/ingest_448_probes.log
}

# The GPU tests at this round's final state (the product's code as at 337c045; the benches changed).
section_check87() { gpu_tests 200 6 tests/test_gpu_tower.py tests/test_gpu.py -o addopts="" -k "not compiled"; }

# Issue 36: the exact preprocessing path (the official mode on CUDA): its bit-identity on CUDA (GPU tests), ingestion
# at 448 px and of 12-MP photos beside gpu-nvjpeg (same call), search p50 with a 12-MP candidate at the defaults, then
# the resize alone and each mode's deviation from the official CPU pixels.
section_exact36() {
  local flags=(--fused --cuda-graphs --bulk-graphs)
  gpu_tests 120 8 tests/test_exact_preprocess.py -o addopts=""
  for pre in official gpu-nvjpeg; do PRE=$pre ingest "ingest_448_$pre" 75 3 448 "${flags[@]}" --repeats 3; done
  for pre in official gpu-nvjpeg; do
    PRE=$pre ingest "ingest_12mp_$pre" 100 3 12mp "${flags[@]}" --batch-size 64 --repeats 2
  done
  photos search_photo_official 90 9 24 4 --preprocess official --cuda-graphs --fused
  [ "${SKIP_DEV:-0}" = 1 ] || step preprocess_dev 80 8 python3 bench/gpu_preprocess_deviation.py --checkpoint "$CKPT" \
    --device cuda --photos 8
  grep -H "runs:\|utilisation\|FLOP limit" "$OUT"/ingest_*.log | sed 's|^[^:]*/||'
}
