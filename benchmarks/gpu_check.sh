#!/usr/bin/env bash
# recsdk on one CUDA GPU, as a user runs it: the little demo, the host stage, and sharded
# training against TorchRec on remapped ids at the workloads of issue #35; prints the JSON lines
# and the ratios. About 4 minutes on one H200 (each step has its own time limit).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # logs: OUT_DIR/<step>.log (default out/gpu_check)
#
# Needs torch with CUDA, fbgemm-gpu and torchrec importable, and recsdk's packages (installed, or
# packages/*/src on PYTHONPATH). One GPU is one rank: nccl cannot run two ranks on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

python3 -c "
import torch, fbgemm_gpu, torchrec
print('torch', torch.__version__, 'torchrec', torchrec.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__)
print('device', torch.cuda.get_device_name(0), 'cores', len(__import__('os').sched_getaffinity(0)))
" || exit 1

failed=0
run() {  # run NAME SECONDS COMMAND...: the command's JSON lines and summary lines, its log kept
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    grep -E '^\{|^little demo|^plan:|eval AUC|^samples/s|^wall time' "$out/$name.log"
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "-- $name failed (exit $rc); the end of its log:"
        tail -n 15 "$out/$name.log"
    fi
    echo "-- $name: $((SECONDS - start))s"
}

# The little demo on one GPU (HashEmbeddingBagCollection + HashEmbeddingCollection, the pipeline).
run demo 60 python3 examples/little_demo/main.py --world-size 1 --device cuda --steps 200 --out "$out/demo"
# The host side of a step at 26 features x 16384 (core time, parts, GIL), with the tables on the GPU.
run host_stage 100 python3 benchmarks/host_stage.py --device cuda --rounds 3 --steps 4 --warmup 15
# Parity at a small workload, then the issue's: 26 features x 1M rows x dim 64, batch 16384, one id
# per feature and sample (426k ids a step).
variants=(hash_rw hash_tw torchrec_rw torchrec_tw)
run small 40 python3 benchmarks/sharded_training.py --device cuda --world-size 1 --workload 3x40000x16 \
    --batch-size 8192 --steps 20 --rounds 5 --variants "${variants[@]}"
run large 90 python3 benchmarks/sharded_training.py --device cuda --world-size 1 --workload 26x1000000x64 \
    --batch-size 16384 --pooling 1 --steps 10 --rounds 5 --variants "${variants[@]}"
# The same with the tables of a step mapped on one thread (the default on a GPU: up to 8).
run large_one_thread 70 python3 benchmarks/sharded_training.py --device cuda --world-size 1 \
    --workload 26x1000000x64 --batch-size 16384 --pooling 1 --steps 10 --rounds 5 --variants hash_rw hash_tw \
    --host-threads 1
exit $failed
