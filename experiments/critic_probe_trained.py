"""The critic probe's trained half (issue 29, item 6): value tokens read through LoRA adapters of the critic's own,
trained briefly on Monte-Carlo targets. Does a little training give SmolLM2-135M a critic that tells states apart?

It reuses the untrained probe's states (``experiments/critic_probe.py``'s ``states.csv``: per held-out word
problem, one sampled response cut after 0, 1/3 and 2/3 of its tokens, each cut with 8 scored continuations). The
response of every problem is sampled again with the probe's seed, and a problem whose response does not come back
the same (length and reward) is left out and counted. The states are split by problem: the first half trains, the
next quarter is the validation split (it picks the number of epochs), the last quarter is the test split, reported
only for the picked setting.

The critic is the library's: LoRA on the policy (``models.adapters.add_lora``; its adapter stays at ``B = 0``, so
the policy is the base model), then adapters of the critic's own (``add_adapter``) read through an ``AdapterView``.
Its value is the ``digits`` reading of the untrained probe: the state, ``" V:"``, the expectation over the grid
``0 .. 9`` (``functional.value_from_grid``, levels ``0, 1/9, .., 1``). It trains on the cross-entropy of the target's
nearest grid bin (``functional.nearest_bin``, ``value_token_ce``: AC2's critic loss), the target being the state's
Monte-Carlo mean, with AdamW in minibatches of ``--batch`` states, the order drawn from the seed (which also draws
the adapters' ``A``). After every epoch the validation and test AUC (each continuation's outcome against its
state's value) and Spearman's ρ (value against the Monte-Carlo mean) are written to ``epochs.csv``; epoch 0 is the
untrained reading through the same code.

Resumable by seed: a seed whose rows are all in ``epochs.csv`` is skipped. Usage::

    .venv/bin/python experiments/critic_probe_trained.py --model ~/.cache/rl_lightning/SmolLM2-135M-Instruct \\
        --probe experiments/studies/critic_probe --out experiments/studies/critic_probe_trained --seeds 0 1 2
    .venv/bin/python experiments/critic_probe_trained.py --out experiments/studies/critic_probe_trained --report
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import time
from pathlib import Path

import torch

from critic_probe import auc, sample, setup_record, single_token_ids  # experiments/ is the script's directory

REPO = Path(__file__).resolve().parents[1]
FIELDS = ["seed", "lr", "epoch", "split", "states", "continuations", "successes", "auc", "spearman", "train_loss"]


def states_of(args: argparse.Namespace, model, tokenizer) -> tuple[list[dict], int]:  # noqa: ANN001
    """The probe's states with their ids (``context + prefix + " V:"``), and how many problems were left out."""
    from rl_lightning.envs.word_problems import ArithmeticWordTask
    from rl_lightning.rollout.encoding import PromptEncoder

    probe = Path(args.probe)
    setup = json.loads((probe / "setup.json").read_text())
    rows = list(csv.DictReader((probe / "states.csv").open()))
    task = ArithmeticWordTask(min_operand=2, max_operand=setup["task"]["max_operand"], num_heldout=setup["problems"],
                              seed=1234)
    reward, prompts = task.default_reward(), task.heldout_prompts()
    encoder = PromptEncoder(tokenizer, add_bos=False, use_chat_template=True)
    query = tokenizer(" V:", add_special_tokens=False)["input_ids"]
    eos, states, dropped = tokenizer.eos_token_id, [], 0
    for problem in sorted({int(r["problem"]) for r in rows})[:args.problems]:
        mine = [r for r in rows if int(r["problem"]) == problem]
        context = encoder.first([prompts[problem].text])[0]
        root = sample(model, context, 1, setup["max_new_tokens"], eos, seed=args.probe_seed * 100_003 + problem)[0]
        same = len(root) == int(mine[0]["response_tokens"]) and math.isclose(
            reward(prompts[problem], tokenizer.decode(root, skip_special_tokens=True)), float(mine[0]["root_reward"]))
        if not same:
            dropped += 1
            continue
        for r in mine:
            outcomes = [int(float(o) > 0.5) for o in r["mc_outcomes"].split()]
            states.append({"problem": problem, "ids": context + root[:int(r["prefix_tokens"])] + query,
                           "mc": float(r["mc_mean"]), "outcomes": outcomes})
    return states, dropped


def values(view, states: list[dict], grid: list[int], pad: int) -> torch.Tensor:  # noqa: ANN001
    """``[S]`` the critic's value of each state (no gradient), in chunks of 16."""
    from rl_lightning.functional import value_from_grid

    out = []
    with torch.no_grad():
        for i in range(0, len(states), 16):
            out.append(value_from_grid(grid_logits(view, states[i:i + 16], grid, pad), levels(len(grid))))
    return torch.cat(out)


def levels(k: int) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, k)


def grid_logits(view, states: list[dict], grid: list[int], pad: int) -> torch.Tensor:  # noqa: ANN001
    """``[B, K]`` the grid's logits after each state (left-padded batch, the last position only)."""
    width = max(len(s["ids"]) for s in states)
    ids = torch.tensor([[pad] * (width - len(s["ids"])) + s["ids"] for s in states])
    mask = torch.tensor([[0] * (width - len(s["ids"])) + [1] * len(s["ids"]) for s in states])
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = view(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]
    return logits[:, grid].float()


def measure(view, states: list[dict], grid: list[int], pad: int) -> dict:  # noqa: ANN001
    from scipy.stats import spearmanr

    v = values(view, states, grid, pad).tolist()
    scores = [x for x, s in zip(v, states) for _ in s["outcomes"]]
    labels = [o for s in states for o in s["outcomes"]]
    mc = [s["mc"] for s in states]
    rho = spearmanr(v, mc)[0] if len(set(mc)) > 1 and len(set(v)) > 1 else math.nan
    return {"states": len(states), "continuations": len(labels), "successes": sum(labels),
            "auc": auc(scores, labels), "spearman": rho}


def run(args: argparse.Namespace) -> None:
    from rl_lightning.functional import nearest_bin, value_token_ce
    from rl_lightning.models.adapters import AdapterView, LoraSettings, adapter_parameters, add_adapter, add_lora
    from rl_lightning.models.policy import load_policy

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = setup_record(Path(args.model).expanduser())  # the tree as the run starts
    model, tokenizer = load_policy(str(Path(args.model).expanduser()), "float32")
    model.eval()  # no dropout: the adapters' own dropout is 0 too
    states, dropped = states_of(args, model, tokenizer)
    problems = sorted({s["problem"] for s in states})
    n = len(problems)
    split_of = {p: "train" if i < n // 2 else "validation" if i < 3 * n // 4 else "test"
                for i, p in enumerate(problems)}
    splits = {name: [s for s in states if split_of[s["problem"]] == name] for name in ("train", "validation", "test")}
    setup.update(probe=str(args.probe), problems=args.problems, dropped_problems=dropped, rank=args.rank,
                 batch=args.batch, lr=args.lr, epochs=args.epochs, states={k: len(v) for k, v in splits.items()})
    previous = json.loads((out / "setup.json").read_text()) if (out / "setup.json").is_file() else None
    if previous is not None:  # a later invocation (more seeds) keeps the first setup and notes its own
        previous.setdefault("resumed", []).append({k: setup[k] for k in ("commit", "threads", "cpu", "kernel", "lr",
                                                                           "epochs", "dropped_problems")})
        setup = previous
    (out / "setup.json").write_text(json.dumps(setup, indent=2) + "\n")
    print(f"[probe_trained] states {setup['states']}, problems left out (response not reproduced): {dropped}",
          flush=True)
    grid, pad = single_token_ids(tokenizer, [str(d) for d in range(10)]), tokenizer.pad_token_id
    rows_path = out / "epochs.csv"
    done = {int(r["seed"]) for r in csv.DictReader(rows_path.open())} if rows_path.is_file() else set()
    new = not rows_path.is_file()
    with rows_path.open("a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for seed in args.seeds:
            if seed in done:
                continue
            torch.manual_seed(seed)
            model, _ = load_policy(str(Path(args.model).expanduser()), "float32")
            model.eval()
            add_lora(model, LoraSettings(rank=args.rank, alpha=2.0 * args.rank))
            add_adapter(model, "critic")
            view = AdapterView(model, "critic")
            params = adapter_parameters(model, "critic")
            optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
            order = random.Random(seed)
            train = splits["train"]
            loss_sum = math.nan
            for epoch in range(args.epochs + 1):
                if epoch:
                    start, total = time.perf_counter(), 0.0
                    shuffled = order.sample(train, len(train))
                    for i in range(0, len(shuffled), args.batch):
                        chunk = shuffled[i:i + args.batch]
                        bins = nearest_bin(torch.tensor([s["mc"] for s in chunk]), levels(len(grid)))
                        loss = value_token_ce(grid_logits(view, chunk, grid, pad), bins).mean()
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
                        total += float(loss.detach()) * len(chunk)
                    loss_sum = total / len(train)
                    print(f"[probe_trained] seed {seed} epoch {epoch}: train CE {loss_sum:.4f} "
                          f"({time.perf_counter() - start:.0f}s)", flush=True)
                for split in ("validation", "test"):
                    m = measure(view, splits[split], grid, pad)
                    writer.writerow({"seed": seed, "lr": args.lr, "epoch": epoch, "split": split, **m,
                                     "train_loss": loss_sum})
                    print(f"[probe_trained] seed {seed} epoch {epoch} {split}: AUC {m['auc']:.3f}, "
                          f"Spearman {m['spearman']:.3f}", flush=True)
                handle.flush()


def report(out: Path) -> str:
    from scipy import stats

    rows = list(csv.DictReader((out / "epochs.csv").open()))
    seeds = sorted({int(r["seed"]) for r in rows})
    epochs = sorted({int(r["epoch"]) for r in rows})

    def cell(split: str, epoch: int, key: str) -> list[float]:
        return [float(r[key]) for r in rows if r["split"] == split and int(r["epoch"]) == epoch]

    def ci(xs: list[float]) -> str:
        if len(xs) < 2:
            return f"{xs[0]:.3f}" if xs else "n/a"
        m, s = sum(xs) / len(xs), stats.tstd(xs)
        return f"{m:.3f} ± {stats.t.ppf(0.975, len(xs) - 1) * s / math.sqrt(len(xs)):.3f}"

    lines = ["| epoch | validation AUC | validation Spearman | test AUC | test Spearman |",
             "| --- | --- | --- | --- | --- |"]
    for e in epochs:
        lines.append(f"| {e} | {ci(cell('validation', e, 'auc'))} | {ci(cell('validation', e, 'spearman'))} | "
                     f"{ci(cell('test', e, 'auc'))} | {ci(cell('test', e, 'spearman'))} |")
    trained = [e for e in epochs if e > 0]
    if trained:
        best = max(trained, key=lambda e: sum(cell("validation", e, "auc")) / len(cell("validation", e, "auc")))
        diffs = [a - b for a, b in zip(cell("test", best, "auc"), cell("test", 0, "auc"))]
        p = stats.ttest_1samp(diffs, 0.0).pvalue if len(diffs) > 1 else math.nan
        lines += ["", f"Picked on validation AUC: epoch {best}. Test AUC there against the untrained reading "
                  f"(epoch 0), paired by seed: {ci(diffs)} (p {p:.2g}); seeds {seeds}."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="~/.cache/rl_lightning/SmolLM2-135M-Instruct")
    parser.add_argument("--probe", default=str(REPO / "experiments" / "studies" / "critic_probe"))
    parser.add_argument("--out", default=str(REPO / "experiments" / "studies" / "critic_probe_trained"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--probe-seed", type=int, default=0, help="the untrained probe's --seed")
    parser.add_argument("--problems", type=int, default=None, help="the probe's first N problems only (a smoke run)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--report", action="store_true", help="print the table from epochs.csv and stop")
    args = parser.parse_args()
    if not args.report:
        run(args)
    print(report(Path(args.out)))


if __name__ == "__main__":
    main()
