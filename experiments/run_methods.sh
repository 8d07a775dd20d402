#!/usr/bin/env bash
# LEGACY: the pre-protocol runner of the older studies (3 seeds, TensorBoard logs, report.py). New comparisons use
# experiments/study.py (pinned setup, validation split, per-item outcomes, CIs and paired tests, config hashes):
# docs/results.md#the-protocol. This script stays so that the older sections' "Command:" lines still run.
# Train every listed method from the same warm start, on the same prompt stream and budget, for each seed,
# then write the study's section of experiments/studies/<study>/README.md and its plot from the TensorBoard logs.
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
# Its runs land in runs/<method>_<preset name>/version_N (e.g. runs/grpo_arithmetic_hard).
# The report goes into the folder experiments/studies/$STUDY/ (default: the preset's name, or "arithmetic" without a
# preset) as the section "$SECTION" of its README.md (default: "Task preset <name>", or "Embedded default: 2-digit
# addition" without a preset): a section of that title is replaced, the rest of the README is kept (a new README
# starts with a title line). The plot is $PLOT (default results_<preset name>.png, or results.png) and the notes
# appended to the section are $NOTES (default results_notes_<preset name>.md, or results_notes.md, when it exists);
# a bare file name for either is taken inside the study folder, a path with a '/' as it is. So the 3-digit table,
# with its plot results_arithmetic_hard.png and notes results_notes_arithmetic_hard.md, is rewritten by
#
#   TASK=configs/tasks/arithmetic_hard.yaml SECTION="Harder single-turn setting: 3-digit addition" \
#     experiments/run_methods.sh "grpo pg reinforce rloo ppo" "0 1 2"
#
# and STUDY=trpo SECTION="..." PLOT=results_trpo.png writes into experiments/studies/trpo/ instead.
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
for var in NOTES HELDOUT PLOT SECTION STUDY; do  # the command that rewrites this very section, as it was run
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
study_dir="experiments/studies/${STUDY:-${suffix:+${suffix#_}}}"
[ "$study_dir" = experiments/studies/ ] && study_dir=experiments/studies/arithmetic
in_study() { case "$1" in */*) echo "$1" ;; *) echo "$study_dir/$1" ;; esac; }  # a bare file name: in the folder
plot="$(in_study "${PLOT:-results${suffix}.png}")"
notes="$(in_study "${NOTES:-results_notes${suffix}.md}")"
if [ -z "${NOTES:-}" ] && [ ! -f "$notes" ]; then notes=""; fi
section="${SECTION:-Task preset ${suffix#_}}"
[ -z "$task" ] && [ -z "${SECTION:-}" ] && section="Embedded default: 2-digit addition"
mkdir -p "$study_dir"
if [ ! -f "$study_dir/README.md" ]; then
  printf '# %s\n\nHeadline numbers of every study: [docs/results.md](../../../docs/results.md).\n\n' \
    "$(basename "$study_dir")" >"$study_dir/README.md"
fi
$bin/python experiments/report.py "${runs[@]}" --out "$study_dir/README.md" --plot "$plot" \
  --section "$section" --command "$command" ${notes:+--notes "$notes"} ${HELDOUT:+--heldout "$HELDOUT"}
