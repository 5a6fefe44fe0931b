#!/usr/bin/env bash
# GPU checks on one CUDA machine, run from the repo root. First it installs what the machine lacks (pydantic,
# mlflow-skinny, botocore & co.) from .gpu/wheels/, which `make gpu-bundle` fills here together with a tokenized
# corpus in .gpu/tokenize/ (the machine has no Spark); carry it: run(carry=[".gpu"], command="bash benchmarks/gpu_checks.sh")
# Without .gpu/wheels it says so in one line and exits 2 before anything runs (a device session is too dear to spend
# on import errors).
#   1. environment (nvidia-smi; python, torch, CUDA, cuDNN, NCCL, triton versions)
#   2. MFU + bf16: benchmarks/gpu_mfu.py on configs/gpu_350m.yaml (ours vs nanoGPT's recipe, torch.compile(model);
#      GPU_VARIANTS="k=v …": rows of ours with a setting changed, e.g. the full-logits loss train.loss_chunk_tokens=0;
#      GPU_PROFILE=1: a torch.profiler table of ours and the recipe in $OUT/profile: each a compile more);
#      then the whole trainer (torchrun, loader, checkpoints, validation, MLflow) on the same config against that
#      step: benchmarks/trainer_gpu.py (skipped without .gpu/tokenize); then gpu_mfu.py on configs/gpu_1b.yaml (0.9 B)
#   3. checkpoint save stall, model + AdamW state on the GPU: ckpt_bench.py --only stall --device cuda
#   4. NCCL: torchrun (1 process) joins an nccl group and all-reduces; then the stall of 3 with the NCCL
#      default group (the Checkpointer's collectives on it, as in a GPU training run)
#   5. (if time is left) the same stall with the model on the CPU, as a baseline on this machine
# Each step has its own timeout and never stops the others; the whole run is bounded by GPU_CHECKS_BUDGET_S
# (default 540 s; run it with timeout_s 600). Everything is logged to $OUT/gpu_checks.log as it happens. After each
# step, what it left running is killed (torchrun starts its ranks in sessions of their own, out of `timeout`'s reach),
# so no step measures beside another's leftovers. Exit status: 0 when every step ran and passed, 1 when one failed or
# was skipped (the summary names it), 2 without the bundle.
#
#   bash benchmarks/gpu_checks.sh          # OUT=<dir> for the results (default var/gpu_checks)
set -o pipefail

WHEELS=$(ls .gpu/wheels/*.whl 2>/dev/null || ls .whl/*.whl 2>/dev/null)
if [[ -z $WHEELS ]]; then
    echo "gpu_checks: no .gpu/wheels/*.whl here: run \`make gpu-bundle\` on the development machine and carry .gpu" >&2
    exit 2
fi
OUT=${OUT:-$PWD/var/gpu_checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 LLMP_PROGRESS=0
START=$SECONDS
END=$((START + ${GPU_CHECKS_BUDGET_S:-540}))
SUMMARY=()
FAILED=0
# every step's processes carry this in their environment (ranks in sessions of their own too): what is left of a step
# when it is over is found by it, and nothing else on the machine is touched
STEP_MARK="LLMP_GPU_CHECKS_STEP=$$-$RANDOM$RANDOM"

reap() {  # reap NAME: kill what step NAME left running, and say so
    local pids="" d
    for d in /proc/[0-9]*; do
        [[ ${d#/proc/} == "$$" ]] && continue
        { tr '\0' '\n' <"$d/environ"; } 2>/dev/null | grep -qxF "$STEP_MARK" && pids+="${d#/proc/} "
    done
    [[ -z $pids ]] && return 0
    echo "### $1 left processes running: $pids; killing them"
    # shellcheck disable=SC2086  # one argument per pid
    kill -9 $pids 2>/dev/null
    sleep 2
    SUMMARY+=("$1: killed the processes it left running ($pids)")
}

step() {  # [STEP_MIN_S=S] step NAME CAP_S CMD...: run CMD under timeout min(CAP_S, time left); its rc, never fatal;
    # skipped when less than STEP_MIN_S (default 20) seconds are left: a step that cannot finish is not started
    local name=$1 cap=$2 min=${STEP_MIN_S:-20} left t t0 rc
    shift 2
    left=$((END - SECONDS))
    t=$((cap < left ? cap : left))
    if ((t < min)); then
        echo "### SKIP $name: ${left} s left of the budget, it needs ${min} s"
        SUMMARY+=("$name: skipped (budget)")
        FAILED=1
        return 99
    fi
    echo
    echo "### [+$((SECONDS - START)) s] $name (timeout $t s): $*"
    t0=$SECONDS
    env "$STEP_MARK" timeout -k 10 "$t" "$@"
    rc=$?
    local why=""
    ((rc == 124 || rc == 137)) && why=" TIMED OUT"
    echo "### [+$((SECONDS - START)) s] $name: rc=$rc$why after $((SECONDS - t0)) s"
    SUMMARY+=("$name: rc=$rc$why ($((SECONDS - t0)) s)")
    ((rc == 0)) || FAILED=1
    reap "$name"
    return $rc
}

main() {
    echo "### gpu_checks start $(date -u +%FT%TZ) in $PWD, OUT=$OUT, budget $((END - START)) s"
    # shellcheck disable=SC2086  # one argument per wheel
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        $WHEELS
    export PYTHONPATH=/tmp/site:$PWD
    if ! python3 -c "import pydantic" 2>/dev/null; then  # no pip here: wheels are zip files
        echo "### pip install of .gpu/wheels did not take; extracting the wheels into /tmp/site"
        for w in $WHEELS; do timeout 60 python3 -m zipfile -e "$w" /tmp/site; done
    fi
    echo "PYTHONPATH=$PYTHONPATH; /tmp/site: $(ls /tmp/site 2>&1 | tr '\n' ' ')"

    # 1. environment
    step "env: nvidia-smi" 30 nvidia-smi
    step "env: nvidia-smi query" 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit,persistence_mode,mig.mode.current --format=csv
    step "env: versions" 60 python3 - <<'EOF'
import os, platform, shutil, subprocess, sys
print("python", sys.version.replace("\n", " "), platform.platform())
print("cpus", os.cpu_count(), "| gcc:", shutil.which("gcc") or shutil.which("cc"))
import numpy, yaml, pydantic, pydantic_core
print("numpy", numpy.__version__, "| pyyaml", yaml.__version__, "| pydantic", pydantic.VERSION, "| pydantic_core",
      pydantic_core.__version__, "from", os.path.dirname(pydantic.__file__))
import torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version(),
      "| cuda available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version(), "| nccl available", torch.distributed.is_nccl_available())
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton: not importable:", e)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "| bf16 supported", torch.cuda.is_bf16_supported())
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    import time
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        a @ a
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 50
    print(f"bf16 matmul 4096^3: {2 * 4096**3 / dt / 1e12:.0f} TFLOP/s")
for m in ("botocore", "mlflow", "sqlalchemy", "pipelines.train.trainer"):  # the trainer's needs, from .gpu/wheels
    try:
        __import__(m)
        print(m, "importable")
    except ImportError as e:
        print(m, "NOT importable:", e)
EOF
    df -h /tmp . 2>/dev/null; free -g 2>/dev/null

    # 2. MFU + bf16 (compile warm-up included; writes var/bench/gpu_mfu.json)
    rm -f var/bench/gpu_mfu.json
    # Each row costs a compile of its own (its "build + warm-up s" column), so by default only the two rows the
    # targets need; then the whole trainer and the 1B rows. More, when the budget allows:
    #   GPU_VARIANTS="train.loss_chunk_tokens=0"  a row of ours with each setting (here the full-logits loss: what
    #                                             the chunked loss is worth), space-separated
    #   GPU_PROFILE=1                             a torch.profiler table of ours and the recipe in $OUT/profile
    EXTRA=()
    [[ ${GPU_PROFILE:-0} == 1 ]] && EXTRA+=(--profile "$OUT/profile")
    read -ra VARIANTS <<<"${GPU_VARIANTS:-}"  # split on spaces, no glob expansion
    for kv in "${VARIANTS[@]}"; do EXTRA+=(--variant "$kv"); done
    # the rows measured are kept whatever happens after them: gpu_mfu.py rewrites its JSON after each row
    NOCOMPILE=()
    step "gpu_mfu (ours vs the compiled recipe)" 300 python3 benchmarks/gpu_mfu.py --steps 50 "${EXTRA[@]}"
    # the comparison stands when ours and the recipe were measured (a variant's or a profile's failure aside)
    if python3 -c 'import json, sys; sys.exit(json.load(open("var/bench/gpu_mfu.json")).get("ratio") is None)' \
            2>/dev/null; then
        cp var/bench/gpu_mfu.json "$OUT/gpu_mfu.json" && echo "copied gpu_mfu.json to OUT"
    else  # torch.compile failed or took too long here: the same comparison with nothing compiled, and the rest so
        [[ -f var/bench/gpu_mfu.json ]] && cp var/bench/gpu_mfu.json "$OUT/gpu_mfu_partial.json"
        rm -f var/bench/gpu_mfu.json
        NOCOMPILE=(--set parallel.compile=false)
        step "gpu_mfu fallback (--no-compile: ours and the recipe eager)" 150 python3 benchmarks/gpu_mfu.py \
            --steps 30 --no-compile
        [[ -f var/bench/gpu_mfu.json ]] && cp var/bench/gpu_mfu.json "$OUT/gpu_mfu_nocompile.json"
    fi

    # 2b. the whole trainer on the same config against that step (steady wall tokens/s ÷ gpu_mfu's ours)
    if [[ -f .gpu/tokenize/manifest.json ]]; then
        STEP_MIN_S=90 step "the whole trainer vs its step (trainer_gpu)" 240 python3 benchmarks/trainer_gpu.py --steps 60 --every 30 \
            --tokenize-manifest .gpu/tokenize/manifest.json --step-json var/bench/gpu_mfu.json --out "$OUT/trainer_gpu.json" \
            "${NOCOMPILE[@]}"
    else
        echo "### SKIP trainer_gpu: no .gpu/tokenize (make gpu-bundle here, then carry .gpu)"
        SUMMARY+=("trainer_gpu: skipped (no .gpu/tokenize)")
        FAILED=1
    fi

    # 2c. the same comparison on the ~1 B config (ours and the compiled recipe)
    STEP_MIN_S=120 step "gpu_mfu 1B (ours vs the compiled recipe)" 240 python3 benchmarks/gpu_mfu.py --spec configs/gpu_1b.yaml \
        --steps 30 --out "$OUT/gpu_mfu_1b.json" ${NOCOMPILE:+--no-compile}

    # 3. async checkpoint stall with the model + AdamW state on the GPU (default gloo group)
    step "ckpt stall, device cuda" 180 python3 benchmarks/ckpt_bench.py --only stall --device cuda \
        --sizes 10m,100m,350m --out "$OUT/ckpt_stall_cuda.json"

    # 4. NCCL under torchrun, then the stall with the NCCL default process group
    if command -v torchrun >/dev/null; then TR=(torchrun); else TR=(python3 -m torch.distributed.run); fi
    step "nccl check (torchrun, 1 proc)" 90 "${TR[@]}" --standalone --nproc-per-node 1 benchmarks/nccl_check.py
    step "ckpt stall, device cuda, nccl group (torchrun)" 150 "${TR[@]}" --standalone --nproc-per-node 1 \
        benchmarks/ckpt_bench.py --only stall --device cuda --backend nccl --sizes 10m,350m \
        --out "$OUT/ckpt_stall_nccl.json"

    # 5. baseline if time is left: the same save with the model on the CPU, on this machine
    if ((END - SECONDS >= 90)); then
        step "ckpt stall, device cpu (baseline)" 120 python3 benchmarks/ckpt_bench.py --only stall --device cpu \
            --sizes 350m --out "$OUT/ckpt_stall_cpu.json"
    else  # a baseline: its absence fails nothing
        SUMMARY+=("ckpt stall, device cpu (baseline): skipped (budget)")
    fi
    rm -rf var/bench/ckpt-sizes

    echo
    echo "### summary after $((SECONDS - START)) s"
    printf '  %s\n' "${SUMMARY[@]}"
    ls -la "$OUT"
    ((FAILED == 0)) || echo "### gpu_checks: a step failed or was skipped (above); the figures measured are in $OUT"
    return $FAILED
}

main 2>&1 | tee -a "$OUT/gpu_checks.log"
exit "${PIPESTATUS[0]}"
