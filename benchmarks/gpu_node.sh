#!/usr/bin/env bash
# Issue 26's checks on a GPU node in one unattended run: the CUDA tests, the GPU feeding benchmark, -j scaling of
# builds, gather threads, the whole suite and the seeds' MNIST experiment on CUDA. Each part writes its log to
# $OUT/<part>.txt and one line to $OUT/summary.txt; each has its own time limit, and no part starts after BUDGET
# seconds (default 540), so a slow or stuck part costs only itself.
#
#     OUT=logs BUDGET=540 bash benchmarks/gpu_node.sh [PART ...]
#
# PARTs (default all, in this order): cuda_tests fuzz_cuda pool bench_gpu suite bench_scale workers bench_threads mnist
# bench_augment profile_steps;
# bench_scale_20k (20,000 photos at -j1 and -j16 against a hand-written joblib pool) runs only when named.
# BENCH_GPU_ARGS, BENCH_THREADS_ARGS and BENCH_SCALE_ARGS (bench_scale_20k's) replace those benchmarks'
# arguments (a shorter run).
# (fuzz_cuda: the recipe fuzzer's Loader oracles on CUDA; pool: N forked workers' start; workers: their tests.)
#
# Python packages the node lacks come as wheels in .whl/ (ignored by git; carried to the node), downloaded
# here for its Python (3.12) with, for each of pydantic pydantic_core annotated-types typing-inspection
# typing_extensions soundfile cffi pycparser pydicom soxr av pycocotools jsonschema (+ its attrs,
# jsonschema-specifications, referencing, rpds-py) nibabel:
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME
# They go into the node's own environment (a throwaway machine), with this checkout installed editable, so
# that the tests' subprocesses, which set PYTHONPATH themselves, find them too; /tmp/site where that fails.
set -u
OUT=${OUT:-gpu-node-logs}
BUDGET=${BUDGET:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}

if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>/dev/null \
        || { $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
                 .whl/*.whl && export PYTHONPATH=/tmp/site; }
fi
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "(not installed: PYTHONPATH)"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    echo "## node: $(nproc) cpus, $(free -g | awk '/Mem:/{print $2}') GiB"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    $PY -c "import torch, numpy, h5py; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'numpy', numpy.__version__, 'h5py', h5py.__version__, 'python', __import__('sys').version.split()[0])" 2>&1
} >> "$OUT/summary.txt"

WANT=" ${*:-cuda_tests fuzz_cuda pool bench_gpu suite bench_scale workers bench_threads mnist bench_augment profile_steps} "
part() {   # part NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 left=$((BUDGET - SECONDS)) t0=$SECONDS rc
    shift 2
    case "$WANT" in *" $name "*) ;; *) return ;; esac
    if [ "$left" -lt 20 ]; then echo "## $name: not started, $left s of the budget left" >> "$OUT/summary.txt"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    echo "## $name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" >> "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.txt" >> "$OUT/summary.txt"
}

part cuda_tests 120 $PY -m pytest -q -rs -p no:cacheprovider tests/test_loader_device.py tests/test_loader_resident.py \
    tests/test_annotation_builds.py tests/test_annotation_properties.py tests/test_targets.py tests/test_mix.py \
    tests/test_device_augment.py tests/test_fused.py
part fuzz_cuda 90 env PRECOMPILE_FUZZ_DEVICE=cuda $PY tests/fuzz_recipes/runner.py --loader-cases 60
part pool 40 $PY benchmarks/bench_scale.py --pool 1,2,4,8,16 --repeats 3
part bench_gpu 200 $PY benchmarks/bench_gpu.py ${BENCH_GPU_ARGS:---samples 8192 --threads 1,2,4,8,15 --prefetch 1,2,4,8 --repeats 5}
suite() {   # the whole suite on every core, then its failures again in one process (xdist artefacts go there)
    set -o pipefail
    $PY -m pytest -q -n 16 -p no:benchmark --timeout 300 -rs 2>&1 | tail -n 40 && return 0
    echo "--- the failures again, in one process (no xdist):"
    $PY -m pytest -q --lf --timeout 300 -p no:xdist -p no:benchmark 2>&1 | tail -n 40
}   # (the node's image has pytest-xdist and pytest-timeout; elsewhere bring their wheels too)
export -f suite
export PY
part suite 150 bash -c suite
part bench_scale 150 $PY benchmarks/bench_scale.py --jobs 1,2,4,8,16 --photos 4000
part bench_scale_20k 240 $PY benchmarks/bench_scale.py ${BENCH_SCALE_ARGS:---jobs 1,16 --photos 20000 --targets 64 --joblib}
part workers 60 $PY -m pytest -q -p no:cacheprovider tests/test_workers.py tests/test_warm_pool.py
part bench_threads 150 $PY benchmarks/bench_threads.py ${BENCH_THREADS_ARGS:---threads 1,2,4,8,15 --repeats 5 --sides 64,224,256}
part mnist 120 $PY benchmarks/bench_mnist.py --device cuda --workers 8 --epochs 3
# the device steps against Kornia and albumentations (their wheels, when carried, in .whl/aug/: not dependencies)
if ls .whl/aug/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/aug/*.whl 2>/dev/null || true
fi
part bench_augment 150 $PY benchmarks/bench_device_augment.py --resnet --fused ${BENCH_AUGMENT_ARGS:---repeats 10 --workers 15}
part profile_steps 60 $PY benchmarks/profile_device_steps.py
cat "$OUT/summary.txt"
