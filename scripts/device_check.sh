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
# the C helpers (host copies, page stack, the store's slot atomics) for this python: the figures
# must be the ones users get from an install with a compiler, not the fallbacks' (the *.so built
# here are git-ignored and for another python, so none travel)
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 || echo "build_ext failed (see build_ext.log)"
python3 - <<'PY' 2>&1 | tee "$OUT/helpers.txt"
import importlib
for name in ("hicache.effects._copy._hostcopy", "hicache.pools._pagestack", "hicache.effects._arena._slotops"):
    try:
        importlib.import_module(name)
        print("helper built:", name)
    except ImportError as error:
        print("helper MISSING:", name, error)
PY
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
