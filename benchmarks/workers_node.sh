#!/bin/bash
# Issue 33's worker checks on a lent multi-core node, unattended, each part under its own time limit:
# the worker tests, N workers' start (fork against loky), and -j scaling of 4,000 and 20,000 photos.
# Output: the tables on stdout, and copies under $OUT when it is set.
#     bash benchmarks/workers_node.sh
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/workers-node}
mkdir -p "$OUT"
W=/tmp/bench-workers
mkdir -p $W
part() {   # part NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "== $name ($(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg))"
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.txt" | tail -40
}
echo "$(nproc) cpus; $(python --version 2>&1); $(python -c 'import numpy, h5py, cv2; print("numpy", numpy.__version__, "h5py", h5py.__version__, "cv2", cv2.__version__)')"
part pool-fork 30 python benchmarks/bench_scale.py --pool 1,2,4,8,16 --repeats 3
part pool-loky 45 env PRECOMPILE_WORKERS=loky python benchmarks/bench_scale.py --pool 2,16 --repeats 3
part jobs-4000 150 python benchmarks/bench_scale.py --jobs 1,2,4,8,16 --photos 4000 --dir $W
part jobs-20000 130 python benchmarks/bench_scale.py --jobs 1,16 --photos 20000 --targets 64 --dir $W
part tests 90 python -m pytest -q -p no:cacheprovider -x tests/test_workers.py
part jobs-4000-loky 60 env PRECOMPILE_WORKERS=loky python benchmarks/bench_scale.py --jobs 1,16 --photos 4000 --targets 64 --dir $W
