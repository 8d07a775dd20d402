#!/usr/bin/env bash
# Train every listed method from the same warm start, on the same prompt stream and budget, for each seed,
# then write docs/results.md and the plot from the TensorBoard logs.
#
#   experiments/run_methods.sh "grpo pg reinforce rloo ppo trpo" "0 1 2"
#
# Each run is `rl-lightning fit --config configs/<method>.yaml` with the seed overridden; logs land in
# runs/<method>/version_N. Runs one after another (parallel runs on 2 cores distort each other's timing).
#
# A task preset (configs/tasks/*.yaml), as a third argument or TASK=..., is stacked after each method's config:
#
#   TASK=configs/tasks/arithmetic_hard.yaml experiments/run_methods.sh "grpo pg reinforce rloo ppo" "0 1 2"
#
# Its runs land in runs/<method>_<preset name>/version_N (e.g. runs/grpo_arithmetic_hard) and the report is
# written as the section "$SECTION" (default: "Task preset <name>") of docs/results.md, with the plot in
# docs/results_<preset name>.png; the rest of docs/results.md is kept, and a section of that title is replaced.
# The 3-digit table of docs/results.md is the section SECTION="Harder single-turn setting: 3-digit addition"
# (its notes: report.py --notes experiments/results_notes_arithmetic_hard.md).
set -euo pipefail
cd "$(dirname "$0")/.."
methods="${1:-grpo pg reinforce rloo ppo}"
seeds="${2:-0 1 2}"
task="${3:-${TASK:-}}"
bin=.venv/bin
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # tiny models gain nothing from threads; avoids oversubscription
task_args=() suffix="" command="experiments/run_methods.sh \"$methods\" \"$seeds\""
if [ -n "$task" ]; then
  [ -f "$task" ] || { echo "run_methods.sh: no task preset $task" >&2; exit 2; }
  suffix="_$(basename "$task" .yaml)"
  task_args=(--config "$task")
  command="TASK=$task $command"
fi
for method in $methods; do
  for seed in $seeds; do
    echo "== $method seed $seed${task:+ ($task)}"
    $bin/rl-lightning fit --config "configs/$method.yaml" "${task_args[@]}" \
      --trainer.logger.init_args.name "$method$suffix" --seed_everything "$seed" \
      --data.init_args.seed "$seed" --model.init_args.seed "$seed" 2>&1 | grep -E "^rl-lightning: val/reward|Error" || true
  done
done
runs=()
for method in $methods; do
  for dir in runs/"$method$suffix"/version_*; do [ -d "$dir" ] && runs+=("$dir"); done
done
if [ -z "$task" ]; then
  $bin/python experiments/report.py "${runs[@]}" --out docs/results.md --plot docs/results.png --command "$command"
else
  $bin/python experiments/report.py "${runs[@]}" --out docs/results.md --plot "docs/results$suffix.png" \
    --section "${SECTION:-Task preset ${suffix#_}}" --command "$command"
fi
