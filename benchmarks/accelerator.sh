#!/usr/bin/env bash
# The accelerator benchmark set: step time of ResNet-50 and ResNet-18 at
# 224 px in the paper's DomainBed setting (3 domains x 33 examples, B = 3,
# k = 4), ResNet-50 with six times the examples (66-image inner steps, where
# the GPU is busier), the MLP and the MNIST CNN, the memory benchmark with
# device peaks, and the training loop end to end against those updates
# (ResNet-50 at 224 px on a PACS-sized folder of 672 JPEGs, with the digits
# CNN; steps 31-60 steady). Run from the repository root on a GPU or TPU host:
#
#   bash benchmarks/accelerator.sh [output_dir]   # default: benchmarks/results
#
# Each benchmark writes <output_dir>/<benchmark>_<platform>_<model>.json and
# is bounded by BENCH_TIMEOUT seconds (default 900), so one slow compile
# does not cost the rest.
set -uo pipefail
out=${1:-benchmarks/results}
limit=${BENCH_TIMEOUT:-900}
mkdir -p "$out"
platform=$(python3 -c "import jax; print(jax.default_backend())")
run() { # name, then the module and its flags
  local name=$1; shift
  echo "== $name"
  timeout "$limit" python3 -m "$@" --out "$out/${name/PLATFORM/$platform}.json"
}
run step_time_PLATFORM_resnet50_224px benchmarks.step_time --model resnet50 --domains 3 --batch 33 --repeats 10 --warmup 2
run step_time_PLATFORM_resnet50_224px_batch198 benchmarks.step_time --model resnet50 --domains 3 --batch 198 --repeats 10 --warmup 2 --no-split
run step_time_PLATFORM_resnet18_224px benchmarks.step_time --model resnet18 --domains 3 --batch 33 --repeats 10 --warmup 2
run step_time_PLATFORM_mlp benchmarks.step_time --model mlp --repeats 20 --warmup 2
run step_time_PLATFORM_mnist_cnn benchmarks.step_time --model mnist_cnn --repeats 20 --warmup 2
run memory_PLATFORM_mlp benchmarks.memory
run end_to_end_PLATFORM_resnet50_224px benchmarks.end_to_end --models resnet50 mnist_cnn --image-size 224 --photo-size 227 --per-class 24 --steps 60 --checkpoint-freq 30
