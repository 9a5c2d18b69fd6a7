#!/usr/bin/env bash
# The GPU checks, on a machine with CUDA and a PyTorch build of its own (the device machine some
# sessions are lent; docs/performance.md "GPU"): the gpu-marked tests, then the bench's gpu section.
# Usage: bash scripts/gpu-check.sh OUT_DIR   (wheels for missing packages, if any, in .whl/)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/gpu-check.sh OUT_DIR}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
# The installed torch is not the pinned CPU build the suite's warning filters were written for.
timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:warnings -m gpu tests/integration/test_gpu.py 2>&1 | tee "$out/pytest.txt"
tests_rc=${PIPESTATUS[0]}
timeout 400 python3 -m bench.sections.gpu --out "$out/gpu.json" > "$out/bench.log" 2>&1
bench_rc=$?
tail -c 6000 "$out/gpu.json" 2>/dev/null || tail -50 "$out/bench.log"
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
