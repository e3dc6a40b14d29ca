#!/usr/bin/env bash
# One device call: install carried wheels, GPU correctness tests, then the reuse benchmark on the 2B architecture.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/test_gpu.py -o addopts="" 2>&1 | tail -8
python3 bench/core_reuse.py --mode gpu "$@" 2>&1 | tee "$OUT/core_reuse.log" | tail -14
