#!/usr/bin/env bash
# The GPU check of issue 26 in one command: at most ~8 minutes on an H200, everything under $OUT
# (default ./gpu_check_out). Each step is time-boxed, goes on after a failure, and adds to summary.json.
#
#   eval/gpu_check.sh              # on the GPU machine: carried wheels, versions, CUDA tests, benchmarks
#   eval/gpu_check.sh --dry-run    # on CPU: the same steps at tiny sizes (kernels interpreted, CUDA-only
#                                  # parts skipped), proving the plumbing end to end
#
# Steps (output file under $OUT; the folder holds at most 8 files, what a GPU lease returns):
#   wheels          .whl/*.whl installed into /tmp/site, put first on PYTHONPATH   wheels.txt
#   versions        python, torch, triton, transformers, the GPU, nvidia-smi        versions.txt
#   pytest          CUDA tests: tests/kernels compiled + the skipif-CUDA tests    pytest.xml
#   generate_check  generate_batch / generate through every read path vs one by one generate_check.json
#   bench_kernels   decode vs copy bandwidth, int4 vs bf16, prefill vs SDPA, e2e   bench_kernels.json
#   swap_overlap    swap copies synchronous vs asynchronous (a side stream)        swap_overlap.json
# and gpu_check.log (every step's output), summary.json (status, seconds, headline figures per step).
#
# Environment: PYTHON (default python3; .venv/bin/python for --dry-run when it exists), OUT, GPU_CHECK_LIMIT_SCALE
# (multiplies every step's time limit; default 1, 4 for --dry-run, whose CPU interprets what a GPU compiles).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "usage: eval/gpu_check.sh [--dry-run]  (unknown argument: $1)" >&2; exit 2 ;;
esac
if [ "$DRY" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PYTHON=${PYTHON:-python3}
SCALE=${GPU_CHECK_LIMIT_SCALE:-$([ "$DRY" = 1 ] && echo 4 || echo 1)}
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOG=$OUT/gpu_check.log
STEPS=$WORK/steps.tsv
: > "$LOG"
: > "$STEPS"
export PYTHON OUT DRY PYTHONUNBUFFERED=1

# hf_paged_cache from this tree without installing it: its package maps hf_paged_cache.kernels to kernels/src/
# (pyproject.toml), so a folder of links stands in for the install. The steps run from $WORK: from the
# repository root, `python -m` and `python -` would find its bare hf_paged_cache/ (no kernels) first.
STAGE=$WORK/stage/hf_paged_cache
mkdir -p "$STAGE"
for entry in "$REPO"/hf_paged_cache/*; do ln -s "$entry" "$STAGE/"; done
ln -s "$REPO/kernels/src" "$STAGE/kernels"
export PYTHONPATH=$WORK/stage${PYTHONPATH:+:$PYTHONPATH} REPO
case "$PYTHON" in /*) ;; */*) PYTHON=$REPO/$PYTHON ;; esac  # a relative path keeps working from $WORK

# step NAME LIMIT_SECONDS OUTPUT COMMAND: run COMMAND (a bash snippet) under `timeout`, log it, record it.
step() {
  local name=$1 limit=$(($2 * SCALE)) output=$3 command=$4 start rc ms
  echo "=== $name (limit ${limit} s): $command" | tee -a "$LOG"
  start=$(date +%s%N)
  (cd "$WORK" && timeout --kill-after=5 "$limit" bash -c "$command") >> "$LOG" 2>&1
  rc=$?
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  record "$name" "$rc" "$((ms / 1000)).$(printf %03d $((ms % 1000)))" "$limit" "$output"
}
record() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STEPS"
  $PYTHON "$REPO/eval/gpu_check_summary.py" "$STEPS" "$OUT" $([ "$DRY" = 1 ] && echo --dry-run) > "$WORK/table.txt" 2>> "$LOG"
}

# 1. wheels: a supported transformers (and what it needs newer than the device has), carried in .whl/.
if compgen -G ".whl/*.whl" > /dev/null; then
  if [ "$DRY" = 1 ]; then  # check the wheels install for the device's Python, without using them here
    step wheels 30 wheels.txt '$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "'"$WORK"'/site" --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
      --only-binary=:all: "$REPO"/.whl/*.whl && ls "'"$WORK"'/site" | grep dist-info | tee "$OUT/wheels.txt"'
  else
    step wheels 30 wheels.txt '$PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site "$REPO"/.whl/*.whl && ls /tmp/site | grep dist-info | tee "$OUT/wheels.txt"'
    export PYTHONPATH=$WORK/stage:/tmp/site${PYTHONPATH#"$WORK/stage"}
  fi
else
  echo "no .whl/ folder: nothing to install" > "$OUT/wheels.txt"
  record wheels skipped 0 $((30 * SCALE)) wheels.txt
fi

# 2. versions
step versions 20 versions.txt '{ $PYTHON - <<"EOF"
import platform
from importlib import metadata

import torch

import hf_paged_cache
import hf_paged_cache.kernels

print("python", platform.python_version(), "| hf_paged_cache from", hf_paged_cache.__file__, hf_paged_cache.kernels.__file__)
for name in ("torch", "triton", "transformers", "accelerate", "tokenizers", "huggingface-hub", "safetensors", "regex",
             "flash-attn", "pytest", "pytest-xdist"):
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "not installed")
if torch.cuda.is_available():
    print("cuda", torch.version.cuda, "|", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
else:
    print("cuda: unavailable")
EOF
nvidia-smi || echo "nvidia-smi: not available"; } > "$OUT/versions.txt" 2>&1; cat "$OUT/versions.txt"'

# 3. CUDA tests: on CUDA tests/kernels run compiled (conftest sets TRITON_INTERPRET only without CUDA); their
# parametrisations are pairwise subsets of the variant grid. The dry run interprets two of them.
CUDA_TESTS="$REPO/tests/memory/test_copy_stream.py::test_cuda_copies_run_on_a_side_stream_after_the_compute_stream \
$REPO/tests/memory/test_swap.py::test_cuda_side_stream_swaps_match_synchronous_ones \
$REPO/tests/serving/test_preemption.py::test_cuda_side_stream_copies_give_the_synchronous_outputs"
if [ "$DRY" = 1 ]; then
  KERNEL_TESTS="$REPO/tests/kernels/test_paged_decode.py::test_decode_empty_batch \
$REPO/tests/kernels/test_paged_prefill.py::test_single_query_prefill_equals_decode"
  WORKERS=""
else
  KERNEL_TESTS=$REPO/tests/kernels
  WORKERS=$($PYTHON -c "import xdist" 2>/dev/null && echo "-n 8")
fi
step pytest 150 pytest.xml "\$PYTHON -m pytest -q -p no:cacheprovider $WORKERS -rfEs --junitxml=\"\$OUT/pytest.xml\" \
  $KERNEL_TESTS $CUDA_TESTS"

# 4. generate_batch with the paged kernels (and every fall-back) against one-by-one outputs.
if [ "$DRY" = 1 ]; then
  step generate_check 50 generate_check.json 'TRITON_INTERPRET=1 $PYTHON "$REPO"/eval/generate_check.py --model tiny-llama \
    --requests 3 --min-len 20 --max-len 40 --new-tokens 4 --threads 1 --out "$OUT/generate_check"'
else
  step generate_check 50 generate_check.json '$PYTHON "$REPO"/eval/generate_check.py --model smollm2-random --device cuda \
    --requests 6 --new-tokens 16 --out "$OUT/generate_check"'
fi

# 5. kernel benchmarks, cut to fit: decode at batch 32 x 4k and 1 x 32k against the copy bandwidth; int4 / int8 /
# fp8 vs bf16 decode at 32 x 16k; prefill vs SDPA (flash-attn if present); the Llama-3-8B-shaped decode end to end.
if [ "$DRY" = 1 ]; then BENCH="--quick"; else
  BENCH="--cells 32q-8kv-d128:32x4096 32q-8kv-d128:1x32768 9q-3kv-d64:32x4096 9q-3kv-d64:1x32768"
fi
step bench_kernels 170 bench_kernels.json "\$PYTHON \"\$REPO\"/eval/bench_kernels.py $BENCH --out \"\$OUT/bench_kernels.json\""

# 6. swap copies under memory pressure: synchronous vs overlapped (a CUDA side stream; "deferred" off CUDA).
if [ "$DRY" = 1 ]; then
  step swap_overlap 60 swap_overlap.json '$PYTHON "$REPO"/eval/swap_overlap.py --model tiny-llama --requests 8 --min-len 20 \
    --max-len 120 --new-tokens 8 --max-batch-tokens 64 --threads 1 --out "$OUT/swap_overlap"'
else
  step swap_overlap 60 swap_overlap.json '$PYTHON "$REPO"/eval/swap_overlap.py --model smollm2-random --out "$OUT/swap_overlap"'
fi

cat "$WORK/table.txt"
rm -rf "$WORK"
