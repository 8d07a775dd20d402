"""The critic probe (issue 29, item 6): can a real model's value tokens tell states apart? Forward only.

On held-out word problems (``ArithmeticWordTask``, the SmolLM2 recipe's task), the policy samples one response per
problem; the response is cut after 0, 1/3 and 2/3 of its tokens. At each cut:

* **Monte-Carlo success** ``MC``: ``continuations`` sampled completions of that prefix (temperature 1, the same
  token budget), scored by the task's verifier; their mean is the state's value estimate, each outcome a label;
* **value-token critics** read by one forward of the prefix followed by a query, the expectation of the grid
  ``V = Σ_k softmax(z_grid)_k v_k`` (``functional.value_from_grid``, what TEMPO's and AC2's generative critic and
  LVRL's ``ValueTokenCritic`` compute), for three readings, none trained:
  - ``digits``: query ``" V:"``, grid ``0 .. 9`` -> ``0, 1/9, .., 1``;
  - ``letters``: query ``" V:"``, grid ``a .. k`` -> ``0, 0.1, .., 1`` (``configs/tempo.yaml``'s grid);
  - ``asked``: the prefix, then ``"\\n\\nHow likely is this answer to be correct, from 0 (wrong) to 9 (right)? "``,
    grid ``0 .. 9``.

Reported per critic, over all cuts and per cut: the AUC of ``V`` against each continuation's outcome (the chance
that a successful continuation's state has the higher value; 0.5 = no signal) and Spearman's rank correlation of
``V`` with ``MC``, with the number of states. A critic whose AUC is near 0.5 cannot guide TEMPO, AC2 or LVRL at this
model size without training; a trained-critic probe (adapters on MC targets) needs LoRA and comes next.

Resumable: one CSV row per state is appended as soon as it is measured; a rerun skips the problems done. The setup
(commit, threads, CPU, torch) is written beside it. Usage::

    .venv/bin/python experiments/critic_probe.py --model ~/.cache/rl_lightning/SmolLM2-135M-Instruct \\
        --out experiments/studies/critic_probe --problems 200
    .venv/bin/python experiments/critic_probe.py --out experiments/studies/critic_probe --report
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CUTS = (0.0, 1 / 3, 2 / 3)
ASK = "\n\nHow likely is this answer to be correct, from 0 (wrong) to 9 (right)? "
FIELDS = ["problem", "cut", "prefix_tokens", "response_tokens", "mc_mean", "mc_outcomes", "v_digits", "v_letters",
          "v_asked", "root_reward"]


def grid_value(model, ids: list[int], grid_ids: list[int], device: str) -> float:  # noqa: ANN001
    """``V`` of the grid after ``ids`` (one forward)."""
    from rl_lightning.functional import value_from_grid

    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, -1].float()
    levels = torch.linspace(0.0, 1.0, len(grid_ids))
    return float(value_from_grid(logits[grid_ids].unsqueeze(0), levels)[0])


def single_token_ids(tokenizer, texts: list[str]) -> list[int]:  # noqa: ANN001
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    bad = [t for t, i in zip(texts, ids) if len(i) != 1]
    if bad:
        raise SystemExit(f"critic_probe: these grid texts are not single tokens of the tokenizer: {bad}")
    return [i[0] for i in ids]


def sample(model, prompt: list[int], n: int, max_new: int, eos: int, seed: int) -> list[list[int]]:  # noqa: ANN001
    """``n`` sampled continuations of ``prompt`` (temperature 1), each cut after its EOS."""
    if max_new <= 0:
        return [[] for _ in range(n)]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new,
                             num_return_sequences=n, pad_token_id=eos, eos_token_id=eos)
    rows = []
    for row in out[:, len(prompt):].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


def setup_record(model_dir: Path) -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"commit": commit, "model": str(model_dir), "threads": torch.get_num_threads(), "cpu": cpu,
            "kernel": os.environ.get("ATEN_CPU_CAPABILITY", "default"), "torch": torch.__version__}


def run(args: argparse.Namespace) -> None:
    from rl_lightning.envs.word_problems import ArithmeticWordTask
    from rl_lightning.models.policy import load_policy
    from rl_lightning.rollout.encoding import PromptEncoder

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = setup_record(Path(args.model).expanduser())
    setup.update(problems=args.problems, continuations=args.continuations, max_new_tokens=args.max_new_tokens,
                 cuts=list(CUTS), task=dict(min_operand=2, max_operand=args.max_operand, operations=["+", "-"]))
    previous = json.loads((out / "setup.json").read_text()) if (out / "setup.json").is_file() else None
    if previous is not None:  # a resumed probe keeps its first setup and notes every later one
        previous.setdefault("resumed", []).append({k: setup[k] for k in ("commit", "threads", "cpu", "kernel")})
        setup = previous
    (out / "setup.json").write_text(json.dumps(setup, indent=2) + "\n")
    model, tokenizer = load_policy(str(Path(args.model).expanduser()), "float32")
    model.eval()
    task = ArithmeticWordTask(min_operand=2, max_operand=args.max_operand, num_heldout=args.problems, seed=1234)
    reward = task.default_reward()
    encoder = PromptEncoder(tokenizer, add_bos=False, use_chat_template=True)
    eos = tokenizer.eos_token_id
    digits = single_token_ids(tokenizer, [str(d) for d in range(10)])
    letters = single_token_ids(tokenizer, list("abcdefghijk"))
    query, ask = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (" V:", ASK))
    rows_path = out / "states.csv"
    done = set()
    if rows_path.is_file():
        done = {int(r["problem"]) for r in csv.DictReader(rows_path.open())}
    new = not rows_path.is_file()
    with rows_path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for index, prompt in enumerate(task.heldout_prompts()):
            if index in done:
                continue
            start = time.perf_counter()
            context = encoder.first([prompt.text])[0]
            root = sample(model, context, 1, args.max_new_tokens, eos, seed=args.seed * 100_003 + index)[0]
            root_reward = reward(prompt, tokenizer.decode(root, skip_special_tokens=True))
            for cut in CUTS:
                k = int(round(cut * len(root)))
                prefix = root[:k]
                if k and prefix[-1] == eos:  # never cut after the end
                    continue
                conts = sample(model, context + prefix, args.continuations, args.max_new_tokens - k, eos,
                               seed=(args.seed * 100_003 + index) * 7 + k + 1)
                outcomes = [reward(prompt, tokenizer.decode(prefix + c, skip_special_tokens=True)) for c in conts]
                state = context + prefix
                writer.writerow({
                    "problem": index, "cut": round(cut, 3), "prefix_tokens": k, "response_tokens": len(root),
                    "mc_mean": sum(outcomes) / len(outcomes), "mc_outcomes": " ".join(f"{o:g}" for o in outcomes),
                    "v_digits": grid_value(model, state + query, digits, "cpu"),
                    "v_letters": grid_value(model, state + query, letters, "cpu"),
                    "v_asked": grid_value(model, state + ask, digits, "cpu"), "root_reward": root_reward})
            handle.flush()
            print(f"[critic_probe] problem {index + 1}/{args.problems}: {time.perf_counter() - start:.1f}s", flush=True)


def auc(scores: list[float], labels: list[int]) -> float:
    """The chance that a positive's score exceeds a negative's (ties count one half)."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return math.nan
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def report(out: Path) -> str:
    from scipy.stats import spearmanr

    rows = list(csv.DictReader((out / "states.csv").open()))
    lines = ["| critic | cut | states | continuations (successes) | AUC | Spearman ρ (p) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for critic in ("v_digits", "v_letters", "v_asked"):
        for cut in (None, *sorted({r["cut"] for r in rows})):
            sel = [r for r in rows if cut is None or r["cut"] == cut]
            scores, labels = [], []
            for r in sel:
                for o in r["mc_outcomes"].split():
                    scores.append(float(r[critic]))
                    labels.append(int(float(o) > 0.5))
            values, mc = [float(r[critic]) for r in sel], [float(r["mc_mean"]) for r in sel]
            rho, p = spearmanr(values, mc) if len(set(mc)) > 1 and len(set(values)) > 1 else (math.nan, math.nan)
            lines.append(f"| {critic[2:]} | {'all' if cut is None else cut} | {len(sel)} | {len(labels)} "
                         f"({sum(labels)}) | {auc(scores, labels):.3f} | {rho:.3f} ({p:.2g}) |")
    spread = [float(r["v_letters"]) for r in rows]
    lines += ["", f"Value spread over states (letters): min {min(spread):.3f}, max {max(spread):.3f}; "
              f"problems {len({r['problem'] for r in rows})}; MC success mean "
              f"{sum(float(r['mc_mean']) for r in rows) / len(rows):.3f}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="~/.cache/rl_lightning/SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=str(REPO / "experiments" / "studies" / "critic_probe"))
    parser.add_argument("--problems", type=int, default=200)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--continuations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", action="store_true", help="print the table from states.csv and stop")
    args = parser.parse_args()
    if args.report:
        print(report(Path(args.out)))
        return
    run(args)
    print(report(Path(args.out)))


if __name__ == "__main__":
    main()
