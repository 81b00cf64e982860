#!/usr/bin/env bash
# tools/gpu_tests.sh: the test suite on a machine with several GPUs, split into one pytest per
# GPU (CUDA_VISIBLE_DEVICES=i), so the whole single-GPU suite fits one lent command. The files
# go to the shards largest first, each to the shard with the fewest bytes so far (a rough
# balance by file size). Tests that need several GPUs at once (tests/test_multi_gpu.py) are left
# out: run them alone (docs/GPU.md). Each shard logs to $GPU_TESTS_OUT/shard<i>.log; the script
# prints each shard's pytest summary line and exits 1 if any shard failed or timed out.
#
#   GPU_TESTS_SHARDS   shards (default: the number of GPUs nvidia-smi lists); more shards than
#                      GPUs put shard i on GPU i mod GPUs (two pytest processes per GPU even
#                      out the files' unequal times: one shard of four ran 540+ s, another 242 s)
#   GPU_TESTS_OUT      log folder (default gpu_tests_out)
#   GPU_TESTS_TIMEOUT  seconds per shard (default 3000)
#   GPU_TESTS_ARGS     more pytest arguments (default -q)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${GPU_TESTS_OUT:-gpu_tests_out}
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
SHARDS=${GPU_TESTS_SHARDS:-$GPUS}
if [ "${SHARDS:-0}" -lt 1 ]; then
    echo "gpu_tests: no GPU listed by nvidia-smi (set GPU_TESTS_SHARDS)" >&2
    exit 1
fi
if [ "${GPUS:-0}" -lt 1 ]; then GPUS=$SHARDS; fi  # nvidia-smi missing: one device per shard
mkdir -p "$OUT"
mapfile -t files < <(ls -S tests/test_*.py | grep -v '^tests/test_multi_gpu.py$')
declare -a shard_files shard_bytes
for ((i = 0; i < SHARDS; i++)); do shard_files[i]=""; shard_bytes[i]=0; done
for f in "${files[@]}"; do
    best=0
    for ((i = 1; i < SHARDS; i++)); do
        if [ "${shard_bytes[i]}" -lt "${shard_bytes[best]}" ]; then best=$i; fi
    done
    shard_files[best]="${shard_files[best]} $f"
    shard_bytes[best]=$((shard_bytes[best] + $(stat -c %s "$f")))
done
pids=()
for ((i = 0; i < SHARDS; i++)); do
    # shellcheck disable=SC2086  # the file list and the arguments split on spaces
    CUDA_VISIBLE_DEVICES=$((i % GPUS)) timeout "${GPU_TESTS_TIMEOUT:-3000}" "$PYTHON" -m pytest \
        ${GPU_TESTS_ARGS:--q} -p no:cacheprovider ${shard_files[i]} >"$OUT/shard$i.log" 2>&1 &
    pids+=($!)
done
status=0
for ((i = 0; i < SHARDS; i++)); do
    wait "${pids[i]}"
    rc=$?
    summary=$(grep -E '(passed|failed|error)' "$OUT/shard$i.log" | tail -1)
    echo "shard $i (GPU $((i % GPUS)), rc $rc):${shard_files[i]}"
    echo "    ${summary:-no summary line}"
    if [ "$rc" -ne 0 ]; then status=1; fi
done
exit $status
