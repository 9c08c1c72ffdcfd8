#!/bin/bash
# The device checks of one GPU session, in order of what matters most (each writes its results
# under $OUT as it goes, so a run cut short keeps what finished):
#   1. `planner profile` of the device: square GEMMs, attention shapes, memory, the host link;
#   2. experiments/check_offload.py: host offload of the Adam moments (then of the master parameters
#      too), planned with the preset and priced with the profile too, compiled, run and timed beside
#      the plan without offload and jax.jit of the step;
#   3. experiments/check_gpu.py --measure-only: the zoo's unsharded steps for the cost-model check
#      (predicted afterwards anywhere with --predict-from).
# Run from the repository root on the device (ortools and its needs carried as wheels in .whl):
#   bash experiments/gpu_checks.sh OUT_DIR [check_gpu models...]
# It writes six files under OUT_DIR (the device tool brings back eight at most); logs stay in /tmp
# and their tails are printed.
set -u
out=${1:?output folder}; shift
models=${*:-gpt2-medium bert-large llama-7b}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
python3 -c "import jax; print(jax.__version__, jax.devices())"
kind=$(python3 -c "import jax; print(jax.devices()[0].device_kind.split()[1].lower())")
t0=$(date +%s)
timeout 130 python3 -m planner.cost_model.profiling --out "$out/profile_$kind.json" --collectives all-reduce \
  > /tmp/profile.log 2>&1; echo "profile rc=$? $(( $(date +%s) - t0 )) s"; tail -30 /tmp/profile.log
prof=()
[ -f "$out/profile_$kind.json" ] && prof=(--profile "$out/profile_$kind.json")
timeout 170 python3 experiments/check_offload.py "${prof[@]}" --out "$out" > /tmp/offload.log 2>&1
echo "offload rc=$? $(( $(date +%s) - t0 )) s"; tail -12 /tmp/offload.log
mkdir -p "$out/params"  # master parameters on the host too (never run on a GPU before this script had it)
timeout 150 python3 experiments/check_offload.py "${prof[@]}" --offload opt-state+params --models gpt2-medium \
  --out "$out/params" > /tmp/offload_params.log 2>&1
echo "offload params rc=$? $(( $(date +%s) - t0 )) s"; tail -4 /tmp/offload_params.log
# shellcheck disable=SC2086
timeout 150 python3 experiments/check_gpu.py --measure-only --models $models --out "$out" > /tmp/gpu_check.log 2>&1
echo "check_gpu rc=$? $(( $(date +%s) - t0 )) s"; tail -5 /tmp/gpu_check.log
