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
# output_dir defaults to benchmarks/results; names (see `run` below, without
# the platform) pick some of the benchmarks, in the order given. Each writes
# <output_dir>/<benchmark>_<platform>_<model>.json and is bounded by
# BENCH_TIMEOUT seconds (default 900), so one slow compile does not cost the
# rest.
set -uo pipefail
out=${1:-benchmarks/results}
shift $(( $# > 0 ? 1 : 0 ))
limit=${BENCH_TIMEOUT:-900}
mkdir -p "$out"
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
)
order=(end_to_end_resnet50_224px end_to_end_resnet18_224px_long
       step_time_resnet50_224px
       trajectory_products_resnet50 step_time_resnet18_224px
       step_time_resnet50_224px_batch198 step_time_mlp step_time_mnist_cnn
       end_to_end_mnist_cnn memory_mlp)
names=("$@")
(( ${#names[@]} )) || names=("${order[@]}")
for name in "${names[@]}"; do
  if [[ -z ${flags[$name]:-} ]]; then
    echo "accelerator.sh: no benchmark named $name; the names: ${order[*]}" >&2
    exit 2
  fi
done
platform=$(python3 -c "import jax; print(jax.default_backend())")
status=0
for name in "${names[@]}"; do
  # The file name puts the platform after the benchmark: step_time_gpu_mlp.
  for benchmark in end_to_end step_time trajectory_products memory; do
    [[ $name == "$benchmark"_* ]] && break
  done
  file=${benchmark}_${platform}_${name#"$benchmark"_}
  echo "== $name"
  # shellcheck disable=SC2086  # The flags split into words.
  timeout "$limit" python3 -m ${flags[$name]} --out "$out/$file.json" || status=1
done
exit $status
