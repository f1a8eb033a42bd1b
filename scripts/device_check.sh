#!/usr/bin/env bash
# The one prepared GPU check for a lent device machine (see DEVELOPERS' brief): the GPU facts
# from scripts/gpu_check.py (JSON), every `gpu`-marked test and the bring-up table, logs under
# $OUT, in about 5 minutes. There python3 has CUDA torch, cuda-bindings, attrs, psutil,
# hypothesis and pytest but not cattrs: carry it as wheels in .whl/ (git-ignored;
# ../.library/device/README.md says how) - with the attrs and typing_extensions it needs (cattrs
# 26.2 needs attrs >= 25.4; the image's attrs version is not known), all pure Python:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     cattrs==26.2.1 attrs==26.1.0 typing_extensions==4.16.0
#   run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=360)
# The bring-up table gets what is left of BUDGET_S (SGLang's path alone takes ~45 s a round at
# 100 GB, so that size is skipped, saying so, when it does not fit); the rerun for it:
#   run(command="bash scripts/device_check.sh bringup", carry=[".whl"], timeout_s=300)
# and for a transfer table cut short (its rows print as they end):
#   run(command="bash scripts/device_check.sh transfers", carry=[".whl"], timeout_s=300)
set -u -o pipefail
WHAT=${1:-all}
case "$WHAT" in all|bringup|transfers) ;; *) echo "device_check.sh: unknown part '$WHAT' (all, bringup, transfers)" >&2; exit 2;; esac
BUDGET_S=${BUDGET_S:-290}
OUT=${OUT:-/tmp/hicache-device}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# fail in seconds, not after the build, where the carried wheels do not make hicache import
python3 -c "import hicache.plan, hicache.effects, hicache.pools" 2>&1 | tee "$OUT/imports.txt" \
    || { echo "hicache does not import here (imports.txt): carry cattrs and what it needs in .whl/"; exit 1; }
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
free -g | tee -a "$OUT/nvidia-smi.txt"
if [ "$WHAT" = bringup ]; then  # the rerun: the bring-up table alone, every size that has the room
    timeout 280 python3 scripts/gpu_bringup.py 2>&1 | tee "$OUT/bringup.json"
    echo "gpu_bringup exit ${PIPESTATUS[0]}"
    exit 0
fi
if [ "$WHAT" = transfers ]; then  # the rerun: the transfer table alone
    timeout 280 python3 scripts/gpu_transfers.py 2>&1 | tee "$OUT/transfers.json"
    echo "gpu_transfers exit ${PIPESTATUS[0]}"
    exit 0
fi
# 2 MiB hugepages for gpu_check's hugetlbfs figure (4 GiB pool), given back after it (and on
# exit): held through the bring-up table they would take 4.4 GB from its 100 GB size's room
hugepages=/proc/sys/vm/nr_hugepages
before=$(cat "$hugepages" 2>/dev/null || echo 0)
if [ -w "$hugepages" ]; then
    trap 'echo "$before" > "$hugepages" 2>/dev/null' EXIT
    echo $((before + 2200)) > "$hugepages" 2>/dev/null || true
fi
echo "hugepages reserved: $(cat "$hugepages" 2>/dev/null) (was $before)"
timeout 170 python3 scripts/gpu_check.py --without-bringup 2>&1 | tee "$OUT/gpu_check.json"
echo "gpu_check exit ${PIPESTATUS[0]} at ${SECONDS} s"
[ -w "$hugepages" ] && echo "$before" > "$hugepages"
# gpu_check.py ran above: its own test would run it again
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_gpu.py \
    --deselect tests/test_gpu.py::test_gpu_check_script_passes 2>&1 | tee "$OUT/pytest-gpu.log"
echo "pytest -m gpu exit ${PIPESTATUS[0]} at ${SECONDS} s"
left=$((BUDGET_S - SECONDS))
[ "$left" -lt 30 ] && left=30  # the first size is measured anyway (nothing to scale from): ~50 s at 37.5 GiB
timeout $((left + 60)) python3 scripts/gpu_bringup.py --time-limit "$left" 2>&1 | tee "$OUT/bringup.json"
echo "gpu_bringup exit ${PIPESTATUS[0]} at ${SECONDS} s"
