#!/usr/bin/env bash
# The one prepared GPU check for a lent device machine (see DEVELOPERS' brief): the GPU facts
# from scripts/gpu_check.py (JSON) and every `gpu`-marked test, logs under $OUT.
# There python3 has CUDA torch, cuda-bindings, attrs, psutil, hypothesis and pytest but not
# cattrs: carry it as wheels in .whl/ (git-ignored; ../.library/device/README.md says how):
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=480)
set -u -o pipefail
OUT=${OUT:-/tmp/hicache-device}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
# 2 MiB hugepages for gpu_check's hugetlbfs figure (4 GiB pool), given back on exit
hugepages=/proc/sys/vm/nr_hugepages
before=$(cat "$hugepages" 2>/dev/null || echo 0)
if [ -w "$hugepages" ]; then
    trap 'echo "$before" > "$hugepages" 2>/dev/null' EXIT
    echo $((before + 2200)) > "$hugepages" 2>/dev/null || true
fi
echo "hugepages reserved: $(cat "$hugepages" 2>/dev/null) (was $before)"
timeout 240 python3 scripts/gpu_check.py 2>&1 | tee "$OUT/gpu_check.json"
echo "gpu_check exit ${PIPESTATUS[0]}"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu.py 2>&1 | tee "$OUT/pytest-gpu.log"
echo "pytest -m gpu exit ${PIPESTATUS[0]}"
