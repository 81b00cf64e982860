#!/usr/bin/env bash
# tools/sanitize.sh: runs tests/test_sanitize_kernels.py, test_sanitize_fused.py,
# test_sanitize_gemm.py and test_sanitize_more.py (every kernel of cuda/*.cu, every recipe, CUDA graphs) under
# compute-sanitizer's memcheck, racecheck,
# initcheck and synccheck, logs each tool to $SANITIZE_OUT/<tool>.log and prints one line per
# tool, "<tool>: N errors", N summed over the sanitizer's summary lines. Exit 1 if a tool
# reports an error (a racecheck warning counts), a pytest run fails, or no test passed (no GPU
# visible: everything skipped). `make sanitize` runs it after the build; docs/sanitize.md says
# how to read the logs. It only runs and counts: what is launched and why is in the test files.
# No pytest covers it; its counting was checked with a stub compute-sanitizer (docs/sanitize.md,
# "Checking the runner").
#
#   SANITIZE_TOOLS="memcheck racecheck initcheck synccheck"   which tools, in this order
#   SANITIZE_OUT=sanitize_out       where the logs go (emptied per tool)
#   SANITIZE_PARALLEL=0             1: all tools at once, tool i on GPU (i mod number of GPUs)
#   SANITIZE_PYTEST_ARGS=           more pytest arguments, e.g. "-k nvfp4" or "-x" (split into
#                                   words: a -k expression with spaces goes in SANITIZE_K)
#   SANITIZE_K=                     a pytest -k expression, passed as one argument,
#                                   e.g. "act_kernels or norm"
#   SANITIZE_ARGS=                  more compute-sanitizer flags, for every tool
#   SANITIZE_EXCLUDE=               kernel-name substrings left uninstrumented (torch / cuBLAS
#                                   only: refused if one matches a tequant kernel name)
#   SANITIZE_DEADLINE=              seconds after the start by which every pytest run is stopped
#                                   (timeout), so a slow tool cannot take the others' summaries
#   COMPUTE_SANITIZER, PYTHON       the binaries (default: compute-sanitizer on PATH or in
#                                   $CUDA_HOME/bin or /usr/local/cuda/bin; python3)
set -uo pipefail
cd "$(dirname "$0")/.."

TOOLS=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}
OUT=${SANITIZE_OUT:-sanitize_out}
PARALLEL=${SANITIZE_PARALLEL:-0}
PYTHON=${PYTHON:-python3}
TESTS=(tests/test_sanitize_kernels.py tests/test_sanitize_fused.py tests/test_sanitize_gemm.py
       tests/test_sanitize_more.py)
GRAPHS="tests/test_sanitize_kernels.py::test_cuda_graph_step"

SAN=${COMPUTE_SANITIZER:-}
if [ -z "$SAN" ]; then
    for c in compute-sanitizer "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
             /usr/local/cuda/bin/compute-sanitizer; do
        if command -v "$c" >/dev/null 2>&1; then SAN=$c; break; fi
    done
fi
if [ -z "$SAN" ]; then
    echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
    exit 1
fi
for tool in $TOOLS; do
    case $tool in
        memcheck|racecheck|initcheck|synccheck) ;;
        *) echo "sanitize: unknown tool '$tool' in SANITIZE_TOOLS" >&2; exit 1 ;;
    esac
done

# tequant's kernel names (the __global__ functions of cuda/*.cu and *.cuh): an exclusion may match
# none.
OURS=$("$PYTHON" - <<'EOF'
import glob, re
src = "".join(open(f).read() for f in sorted(glob.glob("cuda/*.cu") + glob.glob("cuda/*.cuh")))
bounds = r"(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?"
print(" ".join(sorted(set(re.findall(r"__global__\s+void\s+" + bounds + r"(\w+)\s*\(", src)))))
EOF
)
if [ -z "$OURS" ]; then
    echo "sanitize: found no __global__ function in cuda/*.cu" >&2
    exit 1
fi
EXCLUDE_FLAGS=()
for s in ${SANITIZE_EXCLUDE:-}; do
    for k in $OURS; do
        if [[ $k == *"$s"* || $s == *"$k"* ]]; then
            echo "sanitize: SANITIZE_EXCLUDE '$s' matches tequant's kernel $k: refused" >&2
            exit 1
        fi
    done
    EXCLUDE_FLAGS+=(--exclude "kernel_substring=$s")
done
read -r -a EXTRA <<< "${SANITIZE_ARGS:-}"
read -r -a PYTEST_EXTRA <<< "${SANITIZE_PYTEST_ARGS:-}"
[ -n "${SANITIZE_K:-}" ] && PYTEST_EXTRA+=(-k "$SANITIZE_K")

# One pytest run under one tool, appended to the tool's log. caching 0 sets
# PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor is its own cudaMalloc, so memcheck sees an access
# past a tensor's end and initcheck a read of bytes never written since the allocation (torch's
# cached blocks hide both). Graph capture cannot allocate that way, so those tests get a pass
# of their own with caching on.
run_pass() {  # tool label caching pytest-selection...
    local tool=$1 label=$2 caching=$3
    shift 3
    local log="$OUT/$tool.log" flags=()
    [ "$tool" = memcheck ] && flags=(--leak-check no --padding 256)
    # initcheck cannot see cuBLAS's bulk-copy (TMA) stores on Hopper; tequant marks its GEMM
    # outputs written through NVTX's memory API (csrc/core/sanitizer_marks.c), the tests mark
    # torch.mm's: NVTX support makes the tool read those marks
    [ "$tool" = initcheck ] && flags=(--nvtx yes)
    local cmd=("$SAN" --tool "$tool" --error-exitcode 1 --target-processes all "${flags[@]}"
               "${EXCLUDE_FLAGS[@]}" "${EXTRA[@]}" "$PYTHON" -m pytest -q -rs -p no:cacheprovider
               "$@" "${PYTEST_EXTRA[@]}")
    {
        echo "### sanitize: $tool, pass '$label', started $(date -u +%FT%TZ)," \
             "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}," \
             "PYTORCH_NO_CUDA_MEMORY_CACHING=$([ "$caching" = 0 ] && echo 1 || echo unset)"
        echo "### ${cmd[*]}"
    } >> "$log"
    local rc limit=()
    if [ -n "${SANITIZE_DEADLINE:-}" ]; then
        local left=$((SANITIZE_DEADLINE - SECONDS))
        if [ "$left" -le 0 ]; then
            echo "### pass '$label' not run: SANITIZE_DEADLINE passed" >> "$log"
            return 124
        fi
        limit=(timeout -k 15 "$left")
    fi
    # SANITIZE_TOOL tells a test which tool runs it (a kernel racecheck cannot follow skips
    # racecheck alone, with the reason in docs/sanitize.md)
    if [ "$caching" = 0 ]; then
        SANITIZE_TOOL=$tool PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${limit[@]}" "${cmd[@]}" >> "$log" 2>&1
    else
        "${limit[@]}" env -u PYTORCH_NO_CUDA_MEMORY_CACHING SANITIZE_TOOL="$tool" "${cmd[@]}" \
            >> "$log" 2>&1
    fi
    rc=$?
    echo "### pass '$label' exit status $rc" >> "$log"
    return $rc
}

# All passes of one tool; the counts go to $OUT/<tool>.result for the summary.
run_tool() {
    local tool=$1 start=$SECONDS rcs=() passes=0
    : > "$OUT/$tool.log"
    if [ "$tool" = memcheck ] || [ "$tool" = initcheck ]; then
        run_pass "$tool" kernels 0 "${TESTS[@]}" --deselect "$GRAPHS"; rcs+=($?)
        run_pass "$tool" cuda-graphs 1 "$GRAPHS"; rcs+=($?)
    else  # racecheck / synccheck: shared memory and barriers, which caching does not affect
        run_pass "$tool" all 1 "${TESTS[@]}"; rcs+=($?)
    fi
    passes=${#rcs[@]}
    awk -v tool="$tool" -v passes="$passes" -v rcs="${rcs[*]}" -v secs=$((SECONDS - start)) '
        # (a second summary line, "N errors were not printed", repeats part of the first)
        /ERROR SUMMARY: [0-9]+ error/ && !/were not printed/ {
            match($0, /ERROR SUMMARY: [0-9]+/); es += substr($0, RSTART + 15, RLENGTH - 15); ne++
        }
        /RACECHECK SUMMARY: [0-9]+ hazard/ {
            nr++
            if (match($0, /[0-9]+ errors?/)) re += substr($0, RSTART, RLENGTH) + 0
            if (match($0, /[0-9]+ warnings?/)) rw += substr($0, RSTART, RLENGTH) + 0
        }
        /Program hit / { api++ }
        !/^=+ / && / in [0-9.]+s/ && /[0-9]+ passed/ { passed = 1 }  # pytest -q summary lines
        !/^=+ / && / in [0-9.]+s/ && /[0-9]+ (failed|errors?)/ { failed = 1 }
        END {
            errors = nr ? re : es; summaries = nr ? nr : ne
            printf "%s %d %d %d %d %d %d %d %s\n", tool, errors, rw, api, summaries, passes, \
                   passed, failed, secs
            print rcs
        }' "$OUT/$tool.log" > "$OUT/$tool.result"
}

# The error sites most reported in a log: "N x kernel" (device frames of sanitizer reports).
where() {
    grep -E '^=+ .* at .+\+0x[0-9a-f]+' "$1" | grep -v 'Host Frame' \
        | sed -E 's/.* at (.+)\+0x[0-9a-f]+.*/\1/' | cut -c1-120 | sort | uniq -c | sort -rn \
        | head -5 | sed -E 's/^ *([0-9]+) /      \1 x /'
}

gpu_list() {
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "${CUDA_VISIBLE_DEVICES//,/ }"; return; fi
    local n=0
    command -v nvidia-smi >/dev/null 2>&1 && n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$n" -gt 0 ] || n=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' \
                          2>/dev/null || echo 0)
    [ "$n" -gt 0 ] || n=1
    seq 0 $((n - 1))
}

mkdir -p "$OUT"
echo "sanitize: $SAN ($("$SAN" --version 2>/dev/null | grep -m1 -i version || echo '?'))," \
     "tools: $TOOLS; logs in $OUT/"
if [ "$PARALLEL" = 1 ]; then
    read -r -a GPUS <<< "$(gpu_list | tr '\n' ' ')"
    i=0
    for tool in $TOOLS; do
        gpu=${GPUS[$((i % ${#GPUS[@]}))]}
        echo "sanitize: $tool on GPU $gpu"
        CUDA_VISIBLE_DEVICES=$gpu run_tool "$tool" &
        i=$((i + 1))
    done
    wait
else
    for tool in $TOOLS; do
        echo "sanitize: $tool ..."
        run_tool "$tool"
    done
fi

status=0
for tool in $TOOLS; do
    { read -r _ errors warnings api summaries passes passed failed secs; read -r rcs; } \
        < "$OUT/$tool.result"
    line="$tool: $errors errors"
    [ "$tool" = racecheck ] && line="$line, $warnings warnings"
    notes=()
    [ "$api" -gt 0 ] && notes+=("$api of them CUDA API errors")
    # exit statuses: 0, 5 (pytest selected no test), 1 (--error-exitcode, or a failed test)
    bad_rc=0 all_empty=1 timed_out=0
    for rc in $rcs; do
        [ "$rc" != 5 ] && all_empty=0
        case $rc in
            0|5) ;;
            1) [ $((errors + warnings)) -gt 0 ] || [ "$failed" = 1 ] || bad_rc=1 ;;
            124|137) timed_out=1 ;;
            *) bad_rc=1 ;;
        esac
    done
    [ "$timed_out" = 1 ] && notes+=("stopped at SANITIZE_DEADLINE: counts are partial")
    [ "$failed" = 1 ] && notes+=("pytest reported failures")
    [ "$bad_rc" = 1 ] && notes+=("exit statuses $rcs: the sanitizer or python stopped")
    [ "$summaries" -lt "$passes" ] && notes+=("$summaries summary lines for $passes runs")
    [ "$passed" = 0 ] && [ "$timed_out" = 0 ] && notes+=("no test passed (no GPU visible?)")
    [ "$all_empty" = 1 ] && notes+=("no test selected")
    notes+=("pytest runs: $passes, $secs s")
    bad=0
    if [ "$errors" -gt 0 ] || [ "$warnings" -gt 0 ] || [ "$failed" = 1 ] || [ "$bad_rc" = 1 ] \
       || [ "$timed_out" = 1 ] || [ "$summaries" -lt "$passes" ] || [ "$passed" = 0 ]; then
        bad=1
        status=1
    fi
    joined=$(printf '%s; ' "${notes[@]}")
    echo "$line (${joined%; })$([ "$bad" = 1 ] && echo " FAILED: see $OUT/$tool.log")"
    if [ "$bad" = 1 ]; then where "$OUT/$tool.log"; fi
done
exit $status
