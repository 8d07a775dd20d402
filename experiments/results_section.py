"""Write docs/results.md's "Protocol studies" section from the protocol studies' CSVs.

    .venv/bin/python experiments/results_section.py            # rewrites the section between its markers

Each study listed in ``STUDIES`` with a pinned setup (``setup.json``) gets its headline table (``study.py``'s
``headline_rows``: the mean of the last evaluations, mean ± 95% CI, the seed-paired difference to the arm's baseline,
p-value and verdict) and a line naming the runs it does not have yet. Nothing is typed by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study as S  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results.md"
BEGIN, END = "<!-- protocol-studies -->", "<!-- /protocol-studies -->"
STUDIES = (
    ("shipped_arithmetic", "Shipped configs on 2-digit addition (a learning check: most mechanisms cannot act here)"),
    ("lag_mechanisms", "Off-policy and single-stream mechanisms on 2-digit addition: one ablation each"),
    ("methods_2026", "The methods papers compare against in 2026 (Dr. GRPO, DAPO, GSPO, CISPO, REINFORCE++), "
                     "2-digit addition"),
    ("reach", "Reach the target (multi-turn, distinct starting states): GRPO against TEMPO, LVRL, CoPE, AC2 and SAO, "
              "each with its ablation"),
    ("reach_critics", "Reach the target: AC2 with its value-token critic on the policy's weights and on weights of "
                      "its own (300 steps)"),
    ("reach_tuned", "Reach the target with settings tuned on validation: AC2 (critic on weights of its own) and "
                    "CoPE (η 0.001), each with its ablation"),
    ("shipped_rest", "The shipped configs no protocol study had run: TRPO and CoPE (η 0.001) on 2-digit addition, AC2 "
                     "on 3-digit addition, and the smoke-task stacks the configs name"),
    ("ablations_rest", "The mechanism ablations no study had run: BPCO's clip and bounded head, EasyPPO's weights and "
                       "critic minibatches (running sums), SAO's band (reach)"),
    ("running_sum", "Running sums written out (long responses): GRPO, and EasyPPO and BPCO with their ablations"),
    ("smollm2_lora", "SmolLM2-135M-Instruct with LoRA adapters: GRPO on word problems, 200 test problems"),
    ("smollm2_engine_parity", "SmolLM2-135M-Instruct with LoRA adapters: GRPO sampling through the built-in engine "
                              "and through vLLM, one environment"),
    ("smollm2_methods", "SmolLM2-135M-Instruct with LoRA adapters: GRPO, RLOO, PPO and EasyPPO where responses hit "
                        "the token cap; Score Centering + IS against truncated IS under a 4-step lag"),
)

#: (method, study, arm): each method's shipped config (the arm whose stack is the config as it ships today) on the
#: task its config or the README names, and on the task built for its mechanism where a study put it there
SHIPPED = (
    ("Policy Gradient", "shipped_arithmetic", "pg"),
    ("REINFORCE", "shipped_arithmetic", "reinforce"),
    ("RLOO", "shipped_arithmetic", "rloo"),
    ("TRPO", "shipped_rest", "trpo"),
    ("PPO", "shipped_arithmetic", "ppo"),
    ("GRPO", "shipped_arithmetic", "grpo"),
    ("Dr. GRPO", "methods_2026", "dr_grpo"),
    ("DAPO", "methods_2026", "dapo"),
    ("GSPO", "methods_2026", "gspo"),
    ("CISPO", "methods_2026", "cispo"),
    ("REINFORCE++", "methods_2026", "reinforce_pp"),
    ("REINFORCE++-baseline", "methods_2026", "reinforce_pp_baseline"),
    ("SPO", "shipped_arithmetic", "spo"),
    ("FlashREINFORCE", "shipped_arithmetic", "flash_reinforce"),
    ("Score Centering", "shipped_arithmetic", "score_centering"),
    ("StableReinforce", "shipped_arithmetic", "stable_reinforce"),
    ("CoPE", "shipped_rest", "cope"),
    ("CoPE", "reach_tuned", "cope"),
    ("CoPE", "shipped_rest", "cope_guess"),
    ("BPCO", "shipped_arithmetic", "bpco_separate"),
    ("BPCO", "running_sum", "bpco_separate"),
    ("EasyPPO", "shipped_arithmetic", "easyppo"),
    ("EasyPPO", "running_sum", "easyppo"),
    ("SAO", "reach", "sao"),
    ("LVRL", "shipped_rest", "lvrl_guess"),
    ("LVRL", "reach", "lvrl"),
    ("TEMPO", "reach", "tempo_own_unscaled"),
    ("TEMPO", "shipped_rest", "tempo_calc"),
    ("AC2", "shipped_rest", "ac2"),
    ("AC2", "reach_tuned", "ac2"),
)


def shipped_table() -> list[str]:
    """One row per ``SHIPPED`` entry from its study's CSVs: the stack, the warm start, the mean of the last k
    evaluations, whether it learns, and the seed-paired difference to the arm's baseline in that study."""
    out = ["| method | stack (configs, arguments) | study | seeds | warm start | last k | learns | Δ vs baseline | "
           "p (seeds) | verdict |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    loaded: dict[str, tuple[S.Study, dict[str, list[S.RunData]]]] = {}
    for method, name, arm in SHIPPED:
        if name not in loaded:
            study = S.load_study(REPO / "experiments" / "studies" / name, check_configs=False)
            loaded[name] = study, S.load_study_runs(study)
        study, runs = loaded[name]
        spec = study.arms[arm]
        stack = " + ".join(f"`{c}`" for c in spec.configs) + (f" `{' '.join(spec.args)}`" if spec.args else "")
        link = f"[{name}](../experiments/studies/{name}/README.md)"
        if arm not in runs:
            out.append(f"| {method} | {stack} | {link} | 0 | | | | | | no run finished yet |")
            continue
        base = study.baseline_of(arm)
        row = next(r for r in S.headline_rows(study, {a: runs[a] for a in dict.fromkeys([arm, base]) if a in runs})
                   if r[0] == arm)
        out.append(f"| {method} | {stack} | {link} | {row[1]} | {row[2]} | {row[3]} (k = {study.last_k}) | {row[4]} | "
                   f"{row[5]} | {row[6]} | {row[8]} |")
    return out


def section() -> list[str]:
    out = [BEGIN, "## Protocol studies", "",
           # one string per line of docs/results.md (a long one in two literals)
           ("Made by `experiments/study.py` under [the protocol](#the-protocol): one pinned setup per study "
            "(commit, `avx2`"),
           ("kernels, 1 thread), the test split, 5 seeds (3 on a real model), the mean of each run's last k "
            "evaluations (the"),
           ("table's header says k), mean ± 95% CI, and the"),
           ("seed-paired difference to the arm's baseline with its p-value (\"within noise\" where its interval "
            "holds 0)."),
           ("Written by `experiments/results_section.py` from the CSVs in each study's folder; the folder's README "
            "has the"),
           "equal-compute table, every run and the notes.", ""]
    for name, title in STUDIES:
        folder = REPO / "experiments" / "studies" / name
        if not (folder / "setup.json").is_file():
            continue
        study = S.load_study(folder, check_configs=False)
        runs = S.load_study_runs(study)
        setup = json.loads((folder / "setup.json").read_text())
        missing = sorted({a for a in study.arms for s in study.seeds
                          if not (S.export_dir(study, a, s) / "run.json").is_file()})
        if not runs:  # started, nothing exported yet: no table, no README to link
            out += [f"### {title}", "", f"`experiments/studies/{name}`: started at commit `{setup['commit'][:10]}`, "
                    "no run finished yet.", ""]
            continue
        line = f"[{name}](../experiments/studies/{name}/README.md): commit `{setup['commit'][:10]}`."
        if missing:
            line += f" Not finished (runs missing): {', '.join(missing)}."
        out += [f"### {title}", "", line, "",
                f"| arm | seeds | warm start | last {study.last_k} | learns | Δ vs baseline | p (seeds) | verdict |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        out += ["| " + " | ".join(row[:7] + row[8:9]) + " |" for row in S.headline_rows(study, runs)]
        out.append("")
    out += ["## Each method's shipped config", "",
            ("Each method's config as it ships today, on the task its config or the README names and on the task "
             "built for"),
            ("its mechanism where a protocol study put it there: the same numbers as the study tables above, one row "
             "per"),
            ("stack. Δ is against the arm's baseline in that study (GRPO on the same task, or a matched baseline: "
             "GRPO at"),
            ("PPO's passes × minibatches, 128 × 1 REINFORCE for a single-rollout method). Guess-the-number has no "
             "split"),
            ("apart from training (its 31 secrets are trained on too): its rows only say whether a stack keeps its "
             "warm start."), "", *shipped_table(), ""]
    return out + [END]


def main() -> None:
    text = RESULTS.read_text()
    block = "\n".join(section()) + "\n"
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END) + 1
        text = text[:start] + block + text[end:]
    else:
        anchor = "## Each method on its config"
        text = text.replace(anchor, block + "\n" + anchor, 1)
    RESULTS.write_text(text)
    print(f"wrote the protocol studies section of {RESULTS}")


if __name__ == "__main__":
    main()
