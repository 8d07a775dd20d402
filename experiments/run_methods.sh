#!/usr/bin/env bash
# Train every listed method from the same warm start, on the same prompt stream and budget, for each seed,
# then write docs/results.md and the plot from the TensorBoard logs.
#
#   experiments/run_methods.sh "grpo pg reinforce rloo ppo trpo" "0 1 2"
#
# Each run is `rl-lightning fit --config configs/<method>.yaml` with the seed overridden; logs land in
# runs/<method>/version_N. Runs one after another (parallel runs on 2 cores distort each other's timing).
set -euo pipefail
cd "$(dirname "$0")/.."
methods="${1:-grpo pg reinforce rloo ppo}"
seeds="${2:-0 1 2}"
bin=.venv/bin
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny models gain nothing from threads; avoids oversubscription
for method in $methods; do
  for seed in $seeds; do
    echo "== $method seed $seed"
    $bin/rl-lightning fit --config "configs/$method.yaml" --seed_everything "$seed" \
      --data.init_args.seed "$seed" --model.init_args.seed "$seed" 2>&1 | grep -E "val/reward at step 0|TensorBoard logs:|Error" || true
  done
done
runs=()
for method in $methods; do
  for dir in runs/"$method"/version_*; do [ -d "$dir" ] && runs+=("$dir"); done
done
$bin/python experiments/report.py "${runs[@]}" --out docs/results.md --plot docs/results.png \
  --command "experiments/run_methods.sh \"$methods\" \"$seeds\""
