#!/bin/bash
# One GPU session's work in one device call (issue 21): bench/gpu_check.py, one process per model, then the
# tables joined, and the CUDA-only tests.  Prepare the wheels on the CPU machine first (this machine's PyPI):
#
#   bash bench/gpu_session.sh --fetch-wheels     # into .whl/ (ignored by git); about 35 MB
#
# then, on the GPU machine, from the repository root (the device tool carries .whl when asked to):
#
#   bash bench/gpu_session.sh                     # gpu.md, gpu.json and logs in $OUT (else bench/results/gpu_run)
#
# and copy gpu.md and gpu.json into bench/results.
#
# The GPU image has its own torch (2.11 with CUDA 13 when this was written; the project pins 2.13, which has no
# wheel small enough to carry) and transformers 5, which the zoo's models do not support: transformers 4.56 and
# the other packages the bench imports travel as wheels.  enformer_pytorch imports polars at import (for a
# dataset class the bench does not use); its 54 MB runtime does not fit in a device call, so an empty module
# stands in for it there.
set -u
WHEELS=(transformers==4.56.2 huggingface_hub==0.36.2 tokenizers==0.22.2 pulp==3.3.2 highspy==1.16.0
  enformer-pytorch==0.8.12 discrete-key-value-bottleneck-pytorch==0.1.1 vector-quantize-pytorch==1.32.0
  torch-einops-utils==0.2.0 einx==0.4.3 loguru==0.7.3 pyfaidx==0.9.2.2 polars==2.1.0 frozendict==2.5.1)
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
fi
OUT=${OUT:-bench/results/gpu_run}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/site/polars && echo "# stands in for polars: see bench/gpu_session.sh" > /tmp/site/polars/__init__.py
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
# One process per model, at once (compiling is single-threaded; each peak is its own process's).  BERT, ViT and
# HyenaDNA widen what the run-time check is seen on; mamba.py and Caduceus need a package not carried.
MODELS=${MODELS:-"gpt2 llama enformer bert vit hyena"}
DEADLINE=${DEADLINE:-300}  # seconds after which a model starts no new configuration
for m in $MODELS; do
  (timeout $((DEADLINE + 100)) python3 -m bench.gpu_check --models "$m" --explain --deadline "$DEADLINE" --out "$OUT/$m" 2>&1 |
    grep -v metrics_context > "$OUT/$m.log") &
done
(timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_model.py > "$OUT/pytest.log" 2>&1) &
wait
joined=()
for m in $MODELS; do [ -f "$OUT/$m/gpu.json" ] && joined+=("$OUT/$m/gpu.json"); done
python3 -m bench.gpu_check --merge "${joined[@]}" --out "$OUT"
for m in $MODELS; do rm -rf "${OUT:?}/$m"; done  # joined into gpu.json
tail -n 3 "$OUT"/*.log
cat "$OUT"/*.log > /tmp/gpu_session.log && rm "$OUT"/*.log && mv /tmp/gpu_session.log "$OUT/logs.txt"  # 8 files come back
cat "$OUT/gpu.md"
