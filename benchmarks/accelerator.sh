#!/usr/bin/env bash
# The accelerator benchmark set, most telling first: the training loop end to
# end against its update (ResNet-50 at 224 px on a PACS-sized folder of 672
# JPEGs; steps 31-60 steady; then ResNet-18 over 200-step intervals, which a
# checkpoint's background write weighs on less), the step time of ResNet-50
# at 224 px in the paper's DomainBed setting (3 domains x 33 examples, B = 3, k = 4) with its
# split into parts, the products over its trajectory, then ResNet-18, ResNet-50
# with six times the examples (66-image inner steps, where the GPU is busier),
# the MLP, the MNIST CNN, the digits CNN's loop end to end and the memory
# benchmark with device peaks. Run from the repository root on a GPU or TPU
# host:
#
#   bash benchmarks/accelerator.sh [output_dir [name ...]]
#
# output_dir defaults to benchmarks/results; names (see `flags` below, without
# the platform) pick some of the benchmarks, in the order given, and a set's
# name (see `sets`) its benchmarks. Each writes
# <output_dir>/<benchmark>_<platform>_<model>.json, its output to the same
# name's .log (so a benchmark cut short leaves what it printed), and is
# bounded by BENCH_TIMEOUT seconds if set, else by its own budget (see
# `budget`; 900 where none is given), so one slow compile does not cost the
# rest. The environment also takes:
#
#   BENCH_COMPILE_CACHE=DIR  share one persistent compilation cache between
#       the benchmarks: a program an earlier one compiled loads from it, so
#       its compile_ms is a load, not a compile (the loop's own runs in
#       end_to_end keep their own caches, cold then warm, either way).
#   BENCH_SMOKE=1  the same commands at tiny sizes (see `smoke_flags`), to
#       check on any CPU that every flag and import works before a device
#       is spent on them; refuses benchmarks/results, whose files it would
#       overwrite with tiny numbers.
#   BENCH_DRY_RUN=1  print each command with its time limit; run nothing.
set -uo pipefail
out=${1:-benchmarks/results}
shift $(( $# > 0 ? 1 : 0 ))
smoke=${BENCH_SMOKE:-}
cores=$(nproc)
declare -A flags=(
  [end_to_end_resnet50_224px]="benchmarks.end_to_end --models resnet50 --image-size 224 --photo-size 227 --per-class 24 --steps 60 --checkpoint-freq 30"
  [end_to_end_resnet18_224px_long]="benchmarks.end_to_end --models resnet18 --image-size 224 --photo-size 227 --per-class 24 --steps 400 --checkpoint-freq 200"
  [step_time_resnet50_224px]="benchmarks.step_time --model resnet50 --domains 3 --batch 33 --repeats 10 --warmup 2"
  [trajectory_products_resnet50]="benchmarks.trajectory_products"
  [step_time_resnet18_224px]="benchmarks.step_time --model resnet18 --domains 3 --batch 33 --repeats 10 --warmup 2"
  [step_time_resnet50_224px_batch198]="benchmarks.step_time --model resnet50 --domains 3 --batch 198 --repeats 10 --warmup 2 --no-split"
  [step_time_mlp]="benchmarks.step_time --model mlp --repeats 20 --warmup 2"
  [step_time_mnist_cnn]="benchmarks.step_time --model mnist_cnn --repeats 20 --warmup 2"
  [end_to_end_mnist_cnn]="benchmarks.end_to_end --models mnist_cnn --steps 60 --checkpoint-freq 30"
  [memory_mlp]="benchmarks.memory"
  # The GPU check's (see `sets`): the loop over 200 steady steps (two
  # 100-step intervals after the first), its input workers on every core of
  # the host; the update's parts traced; trials stepped together.
  [end_to_end_resnet50_224px_200steps]="benchmarks.end_to_end --models resnet50 --image-size 224 --photo-size 227 --per-class 24 --steps 300 --checkpoint-freq 100 --num-workers $cores"
  [end_to_end_resnet18_224px_200steps]="benchmarks.end_to_end --models resnet18 --image-size 224 --photo-size 227 --per-class 24 --steps 300 --checkpoint-freq 100 --num-workers $cores"
  [step_time_resnet50_224px_erm_fish_pgrad]="benchmarks.step_time --model resnet50 --domains 3 --batch 33 --repeats 10 --warmup 2 --methods erm rollout fish pgrad-B"
  [profile_update_resnet50_224px]="benchmarks.profile_update --model resnet50 --image-size 224 --domains 3 --batch 33 --warmup 2 --calls 1"
  [vmap_trials_mnist_cnn_28px]="benchmarks.vmap_trials --model mnist_cnn --image-size 28 --width 16 --trials 1 3 8 --algorithms ERM PGrad-B --repeats 10"
  [vmap_trials_resnet18_32px]="benchmarks.vmap_trials --model resnet18 --image-size 32 --trials 1 3 8 --algorithms PGrad-B --repeats 10"
)
# Seconds each benchmark may run, where a set needs them to fit. The GPU
# check's add up to 460 s, under 8 minutes of an H200. Estimated from the
# committed H200 and H100 JSONs (compiles included), the H200's end_to_end
# log, and, for vmapped programs, their compiles on CPU (1.3-2.4 times the
# separate update's, with 1 and 2 trials):
# * step_time, ResNet-50 (~85 s): compiles of 18.2 (ERM), 16.0 (rollout),
#   14.8 (Fish) and 17.0 s (PGrad-B), 7 s for the split's parts, 12 rounds
#   of 0.27 s, and the process's start and the model's initialisation.
# * profile_update, ResNet-50 (~25 s): PGrad-B's and the rollout's programs
#   loaded from the compile cache step_time filled (~50 s without), 3 calls
#   each, and two traces written and read.
# * end_to_end, ResNet-50 (~300 s): ERM's and PGrad-B's updates from the
#   cache, then a cold and a warm run of each, ~55 s of start-up,
#   evaluation and checkpoints a run (a 60-step ResNet-18 run took 67 s)
#   and 300 steps of ~60 (ERM) and ~120 ms (PGrad-B). It does not fit: the
#   time limit cuts PGrad-B's warm run, and the JSON, written after every
#   run, keeps the others.
# * vmap_trials, digits CNN (~40 s): 2 x 4 compiles of 3-8 s (the H100's
#   separate updates compiled in 2.9 and 3.4 s), 10 rounds of milliseconds.
# * vmap_trials, ResNet-18 at 32 px (~70 s): PGrad-B's update compiled once
#   separate (11.5 s at 224 px) and three times vmapped (~15-25 s each).
# ResNet-18's loop over 200 steady steps (~250 s: four runs of ~60 s) does
# not fit beside them: gpu_check_resnet18_loop is the next command for it.
declare -A budget=(
  [step_time_resnet50_224px_erm_fish_pgrad]=95
  [profile_update_resnet50_224px]=35
  [end_to_end_resnet50_224px_200steps]=215
  [vmap_trials_mnist_cnn_28px]=45
  [vmap_trials_resnet18_32px]=70
  [end_to_end_resnet18_224px_200steps]=270
)
declare -A sets=(
  [gpu_check]="step_time_resnet50_224px_erm_fish_pgrad profile_update_resnet50_224px end_to_end_resnet50_224px_200steps vmap_trials_mnist_cnn_28px vmap_trials_resnet18_32px"
  [gpu_check_resnet18_loop]="end_to_end_resnet18_224px_200steps"
)
# BENCH_SMOKE's flags, by benchmark, after the others (the last of a flag
# wins): the smallest ResNet at 16 px, a few examples, one or two steps.
declare -A smoke_flags=(
  [end_to_end]="--models resnet18 --image-size 16 --photo-size 16 --per-class 2 --batch 3 --steps 2 --checkpoint-freq 1 --eval-examples 4 --repeats 1 --warmup 0"
  [step_time]="--model resnet18 --image-size 16 --batch 3 --repeats 1 --warmup 0"
  [profile_update]="--model resnet18 --image-size 16 --batch 3 --warmup 0"
  [vmap_trials]="--image-size 8 --width 8 --domains 2 --batch 3 --trials 1 2 --repeats 1"
  [trajectory_products]=""
  [memory]=""
)
order=(end_to_end_resnet50_224px end_to_end_resnet18_224px_long
       step_time_resnet50_224px
       trajectory_products_resnet50 step_time_resnet18_224px
       step_time_resnet50_224px_batch198 step_time_mlp step_time_mnist_cnn
       end_to_end_mnist_cnn memory_mlp)
names=()
for name in "$@"; do
  if [[ -n ${sets[$name]:-} ]]; then
    read -ra members <<< "${sets[$name]}"
    names+=("${members[@]}")
  else
    names+=("$name")
  fi
done
(( ${#names[@]} )) || names=("${order[@]}")
for name in "${names[@]}"; do
  if [[ -z ${flags[$name]:-} ]]; then
    echo "accelerator.sh: no benchmark named $name; the names:" \
         $(printf '%s\n' "${!flags[@]}" | sort) "; the sets:" \
         $(printf '%s\n' "${!sets[@]}" | sort) >&2
    exit 2
  fi
done
if [[ -n $smoke && $(realpath -m "$out") == $(realpath -m benchmarks/results) ]]; then
  echo "accelerator.sh: BENCH_SMOKE writes tiny numbers; give it another" \
       "output_dir than benchmarks/results." >&2
  exit 2
fi
if [[ -n ${BENCH_COMPILE_CACHE:-} ]]; then
  export JAX_COMPILATION_CACHE_DIR=$BENCH_COMPILE_CACHE
fi
mkdir -p "$out"
if ! platform=$(python3 -c "import jax; print(jax.default_backend())"); then
  echo "accelerator.sh: python3 cannot import jax; activate the environment" \
       "the benchmarks run in." >&2
  exit 2
fi
status=0
for name in "${names[@]}"; do
  # The file name puts the platform after the benchmark: step_time_gpu_mlp.
  for benchmark in end_to_end step_time trajectory_products memory \
                   profile_update vmap_trials; do
    [[ $name == "$benchmark"_* ]] && break
  done
  file=${benchmark}_${platform}_${name#"$benchmark"_}
  limit=${BENCH_TIMEOUT:-${budget[$name]:-900}}
  command="python3 -m ${flags[$name]}${smoke:+ ${smoke_flags[$benchmark]}} --out $out/$file.json"
  echo "== $name (at most $limit s)"
  if [[ -n ${BENCH_DRY_RUN:-} ]]; then
    echo "timeout $limit $command"
    continue
  fi
  # shellcheck disable=SC2086  # The flags split into words.
  timeout "$limit" $command 2>&1 | tee "$out/$file.log"
  (( PIPESTATUS[0] )) && status=1
done
exit $status
