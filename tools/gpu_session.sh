#!/bin/bash
# The GPU experiment in one lease of a GPU machine (the device tool's `run`), from the repository root:
#   carry: .whl (wheels of what the machine lacks; torchao's among them turns on test_gpu's torchao check of the MX
#   quantizer), .gpu (the tiktoken cache), outputs/gpu/_data (the prepared EurLex data)
#   1. the gpu-marked tests (CUDA bit-exactness, the compiled layer included), 2. the host syncs of one step
#   (tools/host_reads.py), 3. the benchmarks (quantize; the 8-bit step vs the BF16 step, eager and compiled; runs per
#   hour against concurrent runs), 4. the requirements' experiment at the gpu preset (tools/gpu_experiment.py) if time is left
#   (it needs more than this script's ~300 s of stages). Everything lands under $OUT as two tars.
#   BUDGET: seconds this script may take in all.
set -u
SITE=$(mktemp -d)   # the carried wheels are installed here
export PYTHONUNBUFFERED=1
BUDGET=${BUDGET:-570}; T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
cap() { local l=$(( BUDGET - $(el) - 25 )); [ $l -lt 1 ] && l=1; [ $l -lt $1 ] && echo $l || echo $1; }   # a stage's timeout: its cap, or the time left (>= 1: `timeout 0` never stops)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 3
export PYTHONPATH=$SITE:$PWD TIKTOKEN_CACHE_DIR=$PWD/.gpu/tiktoken_cache WANDB_MODE=disabled
D=outputs/gpu/_data/eurlex; R=$(mktemp -d); mkdir -p $R      # $OUT returns at most 8 files: R is tarred into it
BENCH=(python3 -m altgrad.bench)   # an array: `timeout` runs no shell function
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; nproc; free -g; } > $R/env.txt 2>&1
echo "[$(el) s] gpu tests"
ALTGRAD_GPU_DATA=$D ALTGRAD_GPU_REPORT=$R/gpu_tests.jsonl timeout $(cap 110) python3 -m pytest tests/test_gpu.py -m gpu -k "not block_quantize" -q -rs -p no:cacheprovider > $R/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -n 3 $R/gpu_tests.log
echo "[$(el) s] gpu tests of the block formats (own stage: their compile time on a GPU is unmeasured)"
ALTGRAD_GPU_REPORT=$R/gpu_tests.jsonl timeout $(cap 60) python3 -m pytest tests/test_gpu.py -m gpu -k block_quantize -q -rs --durations=5 -p no:cacheprovider > $R/gpu_tests_blocks.log 2>&1
echo "block tests rc=$?"; tail -n 3 $R/gpu_tests_blocks.log
echo "[$(el) s] host syncs of one step (E5M2 on the grid, stochastic landing, with the shadow)"
timeout $(cap 40) python3 tools/host_reads.py --data-dir $D --preset gpu --fmt E5M2 --set shadow=true --set master_weights=format --set weight_update=stochastic > $R/host_reads.json 2> $R/host_reads.err; echo "rc=$?"
echo "[$(el) s] bench quantize"
timeout $(cap 40) "${BENCH[@]}" quantize --device cuda --repeats 5 --formats E5M2,E4M3,E7M0 > $R/bench_quantize.json 2> $R/bench_quantize.err; echo "rc=$?"
echo "[$(el) s] bench train (plain BF16 vs E5M2, shadow; eager and compile=on)"
timeout $(cap 120) "${BENCH[@]}" train --preset gpu --fmt E5M2 --steps 12 --warmup 3 --compiled --data-dir $D > $R/bench_train.json 2> $R/bench_train.err; echo "rc=$?"
echo "[$(el) s] bench jobs (eager: a compiled job would pay its compilation in every short wave)"
timeout $(cap 75) "${BENCH[@]}" jobs --preset gpu --set fmt=E5M2 --set shadow=true --set compile=off --jobs 1,4,8 --steps 30 --data-dir $D > $R/bench_jobs.json 2> $R/bench_jobs.err; echo "rc=$?"
K=$(python3 -c "import json; print(json.load(open('$R/bench_jobs.json'))['knee'])" 2>/dev/null || echo 8); [ "$K" -lt 6 ] && K=6   # at least the reference and the five FP32-master formats at once: the lease is short (this overrides a lower knee)
LEFT=$(( BUDGET - $(el) - 75 )); [ $LEFT -lt 150 ] && LEFT=0   # the deadline leaves grace, compaction and the tars their time
echo "[$(el) s] experiment: jobs $K, deadline $LEFT s"
tar -cf $OUT/res.tar -C $R .   # what is measured so far comes back even if the experiment overruns the lease
[ $LEFT -gt 0 ] && timeout -k 10 $(( LEFT + 50 )) python3 tools/gpu_experiment.py --out outputs/gpu --data-dir $D --preset gpu --jobs $K --deadline $LEFT --grace 30 > $R/experiment.log 2>&1; echo "rc=$?"
grep -h '"state"' outputs/gpu/experiment.json | sort | uniq -c
cp outputs/gpu/.jobs/*.log $R/ 2>/dev/null
tar -cf $OUT/res.tar -C $R .
tar -czf - --exclude=_data --exclude=checkpoints --exclude='*.log' --exclude=metrics.jsonl --exclude=wandb outputs/gpu | split -b 15m - $OUT/gpu_runs.tgz.   # pieces of <= 15 MiB
ls -la $OUT; echo "[$(el) s] done"
