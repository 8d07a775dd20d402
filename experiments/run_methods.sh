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
# (its notes: NOTES=experiments/results_notes_arithmetic_hard.md). SECTION (and PLOT, NOTES) also work without a
# task preset: the table becomes that section of docs/results.md instead of the whole file.
# A method's tuned settings for a task, configs/tasks/<preset>_<method>.yaml (e.g. guess_ppo.yaml), are stacked
# after the preset when they exist. Finished runs (seed and max_steps reached) are skipped: rerunning the script
# resumes a table, and only the finished runs of the listed methods and seeds are reported.
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
for var in NOTES HELDOUT PLOT SECTION; do  # the command that rewrites this very section, as it was run
  if [ -n "${!var:-}" ]; then command="$var=\"${!var}\" $command"; fi
done
# A run counts as done when its directory's config has the seed and its last.ckpt reached the config's max_steps;
# done runs are skipped, so the script resumes where it stopped (an interrupted run is started again).
done_run() {  # done_run NAME SEED -> prints the finished run directory, if any (report.py's finished_run)
  $bin/python -c "import sys; sys.path.insert(0, 'experiments'); from report import finished_run
run = finished_run(sys.argv[1], int(sys.argv[2])); print(run if run else '', end='')" "$1" "$2"
}
runs=()
for method in $methods; do
  for seed in $seeds; do
    dir="$(done_run "$method$suffix" "$seed")"
    if [ -n "$dir" ]; then
      echo "== $method seed $seed${task:+ ($task)}: done ($dir)"
    else
      echo "== $method seed $seed${task:+ ($task)}"
      extra=()
      tuned="configs/tasks/$(basename "${task:-none}" .yaml)_$method.yaml"
      if [ -n "$task" ] && [ -f "$tuned" ]; then extra=(--config "$tuned"); fi
      $bin/rl-lightning fit --config "configs/$method.yaml" "${task_args[@]}" "${extra[@]}" \
        --trainer.logger.init_args.name "$method$suffix" --seed_everything "$seed" \
        --data.init_args.seed "$seed" --model.init_args.seed "$seed" 2>&1 | grep -E "^rl-lightning: val/reward|Error" || true
      dir="$(done_run "$method$suffix" "$seed")"
    fi
    if [ -n "$dir" ]; then runs+=("$dir"); fi
  done
done
# HELDOUT says what val/reward is measured on, in the header (default "500 fixed held-out prompts").
if [ -z "$task" ] && [ -z "${SECTION:-}" ]; then
  $bin/python experiments/report.py "${runs[@]}" --out docs/results.md --plot docs/results.png --command "$command"
else
  plot="docs/results${suffix}.png"
  [ -n "${PLOT:-}" ] && plot="$PLOT"
  $bin/python experiments/report.py "${runs[@]}" --out docs/results.md --plot "$plot" \
    --section "${SECTION:-Task preset ${suffix#_}}" --command "$command" ${NOTES:+--notes "$NOTES"} \
    ${HELDOUT:+--heldout "$HELDOUT"}
fi
