#!/usr/bin/env bash
# The whole GPU check of a session on a CUDA machine, as one command that fits one device call (< 9 minutes on an
# H200), everything written under $OUT (default ./gpu-session-out):
#
#     bash tools/gpu_session.sh [--dry-run] [--steps env,build,check,accuracy,bench,bench-fl] [--budget SECONDS]
#
# Steps, in order, each with a time limit (never more than what is left of --budget, default 540 s, less the least
# the later steps need; a step that cannot get its least is skipped, saying so), its output in OUT/<step>.log:
#   env       the GPU, torch, nvcc and both compilers; wheels in .gpu_carry/*.whl (e.g. liger-kernel 0.8.5) are
#             installed into /tmp/gpu-session-site (no registry there) and put on PYTHONPATH
#   build     tools/gpu_check.py --build-only --compilers default,system: the machine's default g++ first (the
#             toolchain probe's refusal, quoted, or a build that must import), then CXX=/usr/bin/g++ CC=/usr/bin/gcc,
#             which stays installed and must import
#   check     tools/gpu_check.py --no-build --no-ptxas: every CUDA test (slow ones included), compute-sanitizer
#             memcheck/racecheck/synccheck, the timing table, torch.compile and CUDA-graph capture, no host
#             synchronisation, the fused-linear loss (and Liger's, where installed)
#   accuracy  tools/measure_accuracy.py --device cuda, 10^5 points per divergence, against mpmath and the CPU; the
#             truth is read from a copy of .gpu_carry/accuracy_truth.npz when carried (else computed there, ~1 minute
#             on 16 cores, and written to OUT for the next session to carry)
#   bench     bandpo-lut bench --device cuda --n 2^26 --batch 512 (each row's share of copy bandwidth; the loss at
#             512 x 8192)
#   bench-fl  bandpo-lut bench --device cuda --fused-linear --fl-dtype float32 bfloat16 --fl-vocab 131072
#             (unfused, fused and, where liger-kernel is installed, Liger; memory and time)
#   ncu       (only when named in --steps) ncu --clock-control none on tools/ncu_workload.py: each band row's kernel
#             at N = 2^26 and the loss at 512 x 8192, speed of light, memory, scheduler (issue slots) and
#             occupancy sections, printed and kept as OUT/ncu.ncu-rep
# A step that needs the extension and finds none built for CUDA (a fresh machine, --steps without build) builds it
# with the system compiler first. Exit status: 0 when every step ran and passed, else 1; a summary table last.
#
# --dry-run (no GPU needed): the same steps on the CPU at tiny sizes, to test this script's plumbing: gpu_check's
# plan instead of builds and checks, the accuracy and bench commands with --device cpu.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DRY=0
BUDGET=540
STEPS="env,build,check,accuracy,bench,bench-fl"
ALL_STEPS=" env build check accuracy bench bench-fl ncu "
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --steps) STEPS=${2:?--steps needs a list}; shift ;;
    --steps=*) STEPS=${1#--steps=} ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET=${1#--budget=} ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_session: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case $BUDGET in ''|*[!0-9]*) echo "gpu_session: --budget: expected whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
for s in ${STEPS//,/ }; do
  case $ALL_STEPS in *" $s "*) ;; *) echo "gpu_session: --steps: unknown step '$s' (known:$ALL_STEPS)" >&2; exit 2 ;; esac
done
OUT=${OUT:-$ROOT/gpu-session-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/session.log") 2>&1
export PY=${PYTHON:-python3}
export CARRY=$ROOT/.gpu_carry
START=$SECONDS
SUMMARY=()
FAILED=0
# The least each step needs to be worth starting, and its limit (seconds).
declare -A LEAST=([env]=10 [build]=60 [check]=150 [accuracy]=30 [bench]=40 [bench-fl]=80 [ncu]=60)
declare -A LIMIT=([env]=30 [build]=200 [check]=330 [accuracy]=120 [bench]=90 [bench-fl]=150 [ncu]=240)

selected() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# What the selected steps after $1 need at the least.
reserve_after() {
  local after=0 total=0 s
  for s in $ALL_STEPS; do
    if [ $after = 1 ] && selected "$s"; then total=$((total + LEAST[$s])); fi
    [ "$s" = "$1" ] && after=1
  done
  echo $total
}

# run_step NAME COMMAND...: the command under its time limit, output to OUT/NAME.log and here.
run_step() {
  local name=$1; shift
  local left=$((BUDGET - (SECONDS - START) - $(reserve_after "$name")))
  local limit=$((LIMIT[$name] < left ? LIMIT[$name] : left))
  if [ "$limit" -lt "${LEAST[$name]}" ]; then
    echo "== [$name] skipped: ${left} s left of the ${BUDGET} s budget, it needs ${LEAST[$name]} s" \
         "(rerun with --steps $name)"
    SUMMARY+=("$(printf '%-9s %-28s %5s' "$name" "skipped (budget)" "-")")
    FAILED=1
    return
  fi
  echo "== [$name] at $((SECONDS - START)) s, limit ${limit} s: $*"
  local t0=$SECONDS
  # a shell function of this script (env_step) runs in a child bash, so that `timeout` can stop it too
  if declare -F "$1" >/dev/null; then set -- bash -c "$(declare -f "$1"); $1"; fi
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  local how="exit $rc"
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && how="killed at its limit (exit $rc)"
  echo "== [$name] $how after $((SECONDS - t0)) s"
  SUMMARY+=("$(printf '%-9s %-28s %5s' "$name" "$how" "$((SECONDS - t0))")")
  [ "$rc" = 0 ] || FAILED=1
}

# A CUDA build of the extension importable here (a warm machine keeps the last one); else build it.
ensure_build() {
  # not in a dry run, and not twice: a build step that ran and failed has said why
  [ $DRY = 1 ] || [ $BUILD_TRIED = 1 ] && return
  BUILD_TRIED=1
  if ! "$PY" -c "import bandpo_lut, sys; from bandpo_lut.runtime import _extension as e; \
sys.exit(0 if e.facts()['build']['with_cuda'] else 1)" >/dev/null 2>&1; then
    echo "== no CUDA build of bandpo_lut is installed: building with the system compiler first"
    run_step build "$PY" "$ROOT"/tools/gpu_check.py --build-only --compilers system --out "$OUT/gpu_check"
  fi
}

env_step() {
  echo "date: $(date -u)"; uname -a
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 || echo "(no nvidia-smi)"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], sys.executable); print('torch', torch.__version__, \
'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  nvcc --version 2>&1 | tail -1 || echo "(no nvcc on PATH)"
  echo "default c++: $(command -v c++) ($(c++ --version 2>&1 | head -1))"
  echo "system g++: $(/usr/bin/g++ --version 2>&1 | head -1)"
  compgen -G "$CARRY/*.whl" >/dev/null || { echo "no wheels in .gpu_carry: nothing to install"; return 0; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-session-site \
    "$CARRY"/*.whl && echo "installed into /tmp/gpu-session-site: $(cd "$CARRY" && ls ./*.whl)"
}

ncu_step() {
  if [ "$DRY" = 1 ]; then
    echo "(dry run: the workload on the CPU, no ncu)"
    "$PY" "$ROOT"/tools/ncu_workload.py --device cpu --n 4096 --batch 2 --tokens 64
    return
  fi
  local ncu
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  "$ncu" --clock-control none --profile-from-start off --nvtx --kernel-name-base demangled \
    --kernel-name regex:bandpo --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
    --section Occupancy --section LaunchStats --export "$OUT/ncu" --force-overwrite \
    "$PY" "$ROOT"/tools/ncu_workload.py || return
  "$ncu" --import "$OUT/ncu.ncu-rep" --page details
}

export DRY OUT ROOT
# Every step runs from an empty folder: from the repository root, `python -m bandpo_lut...` would import the source
# tree (which holds no compiled extension) instead of the build installed by the build step.
cd "$(mktemp -d)" || exit 1
echo "gpu_session: steps $STEPS; budget $BUDGET s; OUT $OUT$([ $DRY = 1 ] && echo '; DRY RUN (CPU, tiny sizes)')"
# the carried wheels (installed by the env step, or by an earlier call on this warm machine)
if [ -d /tmp/gpu-session-site ] || compgen -G "$CARRY/*.whl" >/dev/null; then
  export PYTHONPATH=/tmp/gpu-session-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ $DRY = 1 ]; then
  DEV=cpu
  GPU_CHECK=("$PY" "$ROOT"/tools/gpu_check.py --dry-run)
  ACC=(--points 100 --divergence kl --workers 1)
  BENCH=(--n 4096 --batch 2 --tokens 64 --repeats 1 --skip-bisection --skip-memory --accuracy-points 0)
  BENCH_FL=(--fl-tokens 64 --fl-hidden 16 --fl-vocab 512 --fl-repeats 1)
else
  DEV=cuda
  GPU_CHECK=("$PY" "$ROOT"/tools/gpu_check.py)
  ACC=(--points 100000 --workers "$(nproc)")
  BENCH=(--n 67108864 --batch 512)    # 2^26: the inputs far past the L2 (a copy-bandwidth share means DRAM)
  BENCH_FL=(--fl-vocab 131072 --fl-repeats 5)
fi
# The accuracy step's truth file: a copy of the carried one (its entries for other points, should this numpy draw
# other points, are then computed again in the copy), else computed here; either way it comes back in OUT.
TRUTH=$OUT/accuracy_truth.npz
[ $DRY = 0 ] && [ -f "$CARRY/accuracy_truth.npz" ] && [ ! -f "$TRUTH" ] && cp "$CARRY/accuracy_truth.npz" "$TRUTH"

selected env && run_step env env_step
BUILD_TRIED=0
selected build && BUILD_TRIED=1 && run_step build "${GPU_CHECK[@]}" --build-only --compilers default,system --out "$OUT/gpu_check"
if selected check; then
  ensure_build
  run_step check "${GPU_CHECK[@]}" --no-build --no-ptxas --sanitizer-timeout 60 --tests-timeout 200 \
    --out "$OUT/gpu_check"
fi
if selected accuracy; then
  ensure_build
  run_step accuracy "$PY" "$ROOT"/tools/measure_accuracy.py --device $DEV "${ACC[@]}" --truth "$TRUTH" --replace-other
fi
if selected bench; then
  ensure_build
  run_step bench "$PY" -m bandpo_lut.cli bench --device $DEV "${BENCH[@]}" --json "$OUT/bench.json"
fi
if selected bench-fl; then
  ensure_build
  run_step bench-fl "$PY" -m bandpo_lut.cli bench --device $DEV --fused-linear --fl-dtype float32 bfloat16 \
    "${BENCH_FL[@]}" --json "$OUT/bench_fused_linear.json"
fi
if selected ncu; then
  ensure_build
  run_step ncu ncu_step
fi

echo
echo "== gpu_session summary ($((SECONDS - START)) s of the ${BUDGET} s budget; logs in $OUT)"
grep -h -E "^  FAIL|ALL OK|SOME CHECKS FAILED|refused by the toolchain probe" "$OUT"/gpu_check/gpu_check.log 2>/dev/null
printf '%-9s %-28s %5s\n' step result s
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
