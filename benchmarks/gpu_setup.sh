# Sourced by the GPU scripts (gpu_peer.sh, gpu_peer_check.sh) from the
# repository root on the device machine: its environment (NVLink multicast
# off), $OUT/results for JSON, and the editable install (no build isolation:
# the device machine has no package index).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results"
python -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
