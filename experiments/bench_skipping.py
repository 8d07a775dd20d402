"""Update time with and without skipping inert rows, and with and without length bucketing.

    .venv/bin/python experiments/bench_skipping.py [--steps 4] [--repeats 5] [--micro-batch-size 32]

Two workloads, both with the shipped GRPO config's model and batch shape (``configs/grpo.yaml``: the embedded
warm start, 16 prompts x G = 8 = 128 rows, seq-mean-token-mean, AdamW, grad clip 1):

* ``config``: real rollouts of that config (its task and sampling settings, ``max_new_tokens = 6``), ``--steps``
  batches drawn from the warm start; groups whose responses all got the same reward have zero advantage;
* ``long``: the same model on a synthetic batch of long, ragged responses (lengths uniform in 1..56 tokens after
  a real prompt) where 20% of the groups (3 of 16) have no reward spread, the case the bucketing is for.

``RLModule.update`` runs on each batch (outside a Trainer, with a real AdamW; the weights are restored before
every update, untimed) with ``skip_inert_rows`` on/off and, at ``--micro-batch-size``, ``length_bucketing`` on/off;
the settings alternate in order within each repeat. Prints the median seconds per update over the repeats
(summed over the batches) and the ratios; every setting's gradient is the same (checked: the largest difference
relative to the largest gradient entry is printed).
"""

from __future__ import annotations

import dataclasses

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from rl_lightning.algorithms import GRPO  # noqa: E402
from rl_lightning.envs import ArithmeticTask  # noqa: E402
from rl_lightning.rollout import RolloutBatch, RolloutDataModule  # noqa: E402
from rl_lightning.rollout.settings import grouped  # noqa: E402


class _Optimizer:
    """What ``update`` needs of Lightning's optimiser wrapper, around a real AdamW."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def _config() -> dict:
    return yaml.safe_load((REPO_ROOT / "configs" / "grpo.yaml").read_text())


def _module(config: dict, **overrides: object) -> GRPO:
    args = {k: v for k, v in config["model"]["init_args"].items() if k != "optimizer"}
    module = GRPO(**{**args, **overrides})
    module.manual_backward = lambda loss: loss.backward()  # type: ignore[method-assign]
    return module


def real_batches(module: GRPO, config: dict, steps: int) -> list[RolloutBatch]:
    data = dict(config["data"]["init_args"])
    task = ArithmeticTask(**data.pop("task")["init_args"])
    dm = RolloutDataModule(task=task, **grouped(data))
    dm.trainer = SimpleNamespace(lightning_module=module, global_rank=0, world_size=1, global_step=0)
    batches = []
    for step in range(steps):
        batches.append(dm.rollout(dm.prompt_batch(step)))
    return batches


def long_batch(module: GRPO, real: RolloutBatch, seed: int = 0, max_len: int = 56) -> RolloutBatch:
    """``real``'s prompts with synthetic responses of 1..max_len tokens; 3 of 16 groups with constant rewards."""
    gen = torch.Generator().manual_seed(seed)
    n, g, p = real.num_rows, real.group_size, real.prompt_length
    lengths = torch.randint(1, max_len + 1, (n,), generator=gen)
    loss_mask = (torch.arange(max_len)[None] < lengths[:, None]).long()
    response = torch.randint(3, module.policy.config.vocab_size, (n, max_len), generator=gen) * loss_mask
    rewards = torch.randint(0, 2, (n,), generator=gen).float()
    groups = rewards.view(-1, g)
    groups[:, 0], groups[:, 1] = 0.0, 1.0  # every group has spread ...
    groups[[2, 7, 12]] = 1.0  # ... but 3 of 16 (~20%)
    batch = RolloutBatch(
        input_ids=torch.cat([real.input_ids[:, :p], response], dim=1),
        attention_mask=torch.cat([real.attention_mask[:, :p], loss_mask], dim=1), prompt_length=p,
        loss_mask=loss_mask, sampler_logprobs=torch.zeros(n, max_len), rewards=groups.flatten(), group_size=g,
        prompt_index=real.prompt_index, truncated=torch.zeros(n, dtype=torch.bool),
    )
    with torch.no_grad():  # on-policy: the sampler's log-probs are the learner's
        batch = dataclasses.replace(batch, sampler_logprobs=module.forward_policy(batch).logprobs)
    return batch


def timed_update(module: GRPO, batches: list[RolloutBatch], state: dict, settings: dict,
                 config: dict) -> tuple[float, list[torch.Tensor], float]:
    """Seconds of ``update`` over ``batches`` (weights restored before each), the first batch's gradient, and the
    fraction of rows skipped."""
    for key, value in settings.items():
        setattr(module, key, value)
    opt_args = config["model"]["init_args"]["optimizer"]["init_args"]
    seconds, grads, skipped = 0.0, [], []
    for i, batch in enumerate(batches):
        module.load_state_dict(state)
        optimizer = _Optimizer(torch.optim.AdamW(module.policy.parameters(), **opt_args))
        module.optimizers = lambda: optimizer  # type: ignore[method-assign]
        captured: list[torch.Tensor] = []
        step = optimizer.optimizer.step
        if i == 0:  # keep the gradient of the first batch's (one) optimiser step
            def capture_and_step() -> None:
                captured.extend(p.grad.clone() for p in module.policy.parameters())
                step()
            optimizer.step = capture_and_step  # type: ignore[method-assign]
        start = time.perf_counter()
        advantages = module.compute_advantages(batch).detach().unsqueeze(-1)
        stats = module.update(batch, advantages, module.loss_weights(batch))
        seconds += time.perf_counter() - start
        skipped.append(float(stats["train/skipped_rows"][0]))
        grads = grads or captured
    return seconds, grads, statistics.mean(skipped)


def bench(name: str, module: GRPO, batches: list[RolloutBatch], args: argparse.Namespace, config: dict) -> None:
    state = {k: v.clone() for k, v in module.state_dict().items()}
    mbs = args.micro_batch_size
    settings = {
        "whole, no skip": dict(micro_batch_size=None, skip_inert_rows=False, length_bucketing=False),
        "whole, skip": dict(micro_batch_size=None, skip_inert_rows=True, length_bucketing=False),
        f"mbs {mbs}, plain": dict(micro_batch_size=mbs, skip_inert_rows=False, length_bucketing=False),
        f"mbs {mbs}, bucketing": dict(micro_batch_size=mbs, skip_inert_rows=False, length_bucketing=True),
        f"mbs {mbs}, skip": dict(micro_batch_size=mbs, skip_inert_rows=True, length_bucketing=False),
        f"mbs {mbs}, skip + bucketing": dict(micro_batch_size=mbs, skip_inert_rows=True, length_bucketing=True),
    }
    times: dict[str, list[float]] = {k: [] for k in settings}
    grads: dict[str, list[torch.Tensor]] = {}
    skipped: dict[str, float] = {}
    timed_update(module, batches, state, settings["whole, no skip"], config)  # warm-up
    for r in range(args.repeats):
        order = list(settings) if r % 2 == 0 else list(reversed(settings))
        for key in order:
            seconds, grads[key], skipped[key] = timed_update(module, batches, state, settings[key], config)
            times[key].append(seconds)
    rows = sum(b.num_rows for b in batches)
    tokens = sum(int(b.loss_mask.sum()) for b in batches)
    padded = sum(b.loss_mask.numel() for b in batches)
    zero_std = statistics.mean(float(module.rollout_metrics(b)["train/zero_std_fraction"]) for b in batches)
    print(f"\n[{name}] {len(batches)} batch(es) x {batches[0].num_rows} rows, {tokens} generated tokens in "
          f"{padded} response cells ({tokens / padded:.0%} filled), zero-variance groups {zero_std:.0%}")
    ref = grads["whole, no skip"]
    scale = max(float(g.abs().max()) for g in ref)
    base_whole, base_mbs = (statistics.median(times[k]) for k in ("whole, no skip", f"mbs {mbs}, plain"))
    for key in settings:
        median = statistics.median(times[key])
        base = base_whole if key.startswith("whole") else base_mbs
        worst = max(float((a - b).abs().max()) for a, b in zip(grads[key], ref)) / scale
        print(f"  {key:<28} {median * 1000 / len(batches):8.1f} ms/update  x{median / base:.2f} of "
              f"{'whole, no skip' if key.startswith('whole') else f'mbs {mbs}, plain'}   skipped rows "
              f"{skipped[key]:.0%}   max|Δgrad|/max|grad| {worst:.1e}")
    print(f"  ({rows} rows, medians of {args.repeats} repeats)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="real rollout batches of the config workload")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = _config()
    module = _module(config)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model "
          f"{config['model']['init_args']['model_name_or_path']} "
          f"({sum(p.numel() for p in module.policy.parameters()) / 1e6:.1f}M params)")
    batches = real_batches(module, config, args.steps)
    bench("config: real rollouts of configs/grpo.yaml", module, batches, args, config)
    bench("long: synthetic 1..56-token responses, 3 of 16 groups constant", module, [long_batch(module, batches[0])],
          args, config)


if __name__ == "__main__":
    main()
