#!/usr/bin/env bash
# The study of the methods whose critics act before a rollout ends (issue 22): TEMPO and LVRL against GRPO on
# guess-the-number and on calculator tool use, AC2 against GRPO on 3-digit addition, 3 seeds each, every method from
# the task's warm start. Each method's budget is GRPO's in sampled tokens (its task preset,
# configs/tasks/<task>_<method>.yaml, sets the steps), and the report plots held-out reward against step, sampled
# tokens and training wall time, with a table at equal compute. Resumable: finished runs are skipped.
#
#   experiments/early_critics.sh            # all three sections of experiments/studies/early_critics/README.md
#   SEEDS="0" experiments/early_critics.sh  # fewer seeds
set -euo pipefail
cd "$(dirname "$0")/.."
seeds="${SEEDS:-0 1 2}"
export STUDY=early_critics
SECTION="Guess-the-number: TEMPO and LVRL against GRPO" HELDOUT="31 held-out secrets" \
  TASK=configs/tasks/guess.yaml experiments/run_methods.sh "grpo tempo lvrl" "$seeds"
SECTION="Calculator tool use: TEMPO and LVRL against GRPO" HELDOUT="100 held-out problems" \
  TASK=configs/tasks/calculator.yaml experiments/run_methods.sh "grpo tempo lvrl" "$seeds"
SECTION="3-digit addition: AC2 against GRPO" \
  TASK=configs/tasks/arithmetic_hard.yaml experiments/run_methods.sh "grpo ac2" "$seeds"
