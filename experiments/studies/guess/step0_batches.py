"""The numbers of the guess study's "First, a bug?" and "Probes" notes that come from step-0 rollout batches of the
warm start (no training): where the aggregation weights sit, sampled success and "bad:" answers per temperature,
and the net weight that each method's aggregation puts on the sampled tokens.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/studies/guess/step0_batches.py
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from rl_lightning.algorithms import GRPO  # noqa: E402
from rl_lightning.envs import GuessNumberTask  # noqa: E402
from rl_lightning.functional import aggregation_weights, group_advantages  # noqa: E402
from rl_lightning.rollout import GroupRollout, RolloutDataModule  # noqa: E402


def data(module: GRPO, temperature: float, seed: int) -> RolloutDataModule:
    """configs/tasks/guess.yaml's data settings with the method configs' 16 prompts x 8 episodes."""
    dm = RolloutDataModule(task=GuessNumberTask(), prompts_per_step=16, group_size=8, max_new_tokens=3,
                           temperature=temperature, strategy=GroupRollout(max_turns=5, max_episode_tokens=32),
                           val_batch_size=31, seed=seed)
    dm.trainer = SimpleNamespace(lightning_module=module, global_rank=0, world_size=1)
    return dm


def main() -> None:
    module = GRPO(model_name_or_path="embedded:guess")
    dm = data(module, 1.0, 0)
    batch = dm.rollout(dm.prompt_batch(0))
    w, obs = aggregation_weights(batch.loss_mask, "seq_mean_token_mean"), batch.turns.obs_mask
    print(f"seed 0, T=1, step 0: weight on observation ids {float((w * obs).sum()):.1f}; row sums "
          f"{w.sum(1).min():.6f}..{w.sum(1).max():.6f} (1/N = {1 / batch.num_rows:.6f}); sampled ids per episode "
          f"{batch.loss_mask.sum(1).float().mean():.1f}, observation ids {obs.sum(1).float().mean():.1f}")
    for temperature in (1.0, 0.7):
        dm = data(module, temperature, 0)
        found = bad = turns = constant = rows = 0
        for step in range(4):
            b = dm.rollout(dm.prompt_batch(step))
            found += float(b.rewards.sum())
            rows += b.num_rows
            bad += sum(r.count("bad:") for r in b.responses)
            turns += int(b.turns.count.sum())
            groups = b.rewards.view(-1, 8)
            constant += int((groups.amax(1) == groups.amin(1)).sum())
        print(f"seed 0, T={temperature}, steps 0-3: sampled success {found / rows:.3f}, 'bad:' answers per turn "
              f"{bad / turns:.3f}, groups without reward spread {constant}/64 ({rows} episodes)")
    for temperature in (1.0, 0.7):
        dm = data(module, temperature, 1)
        b = dm.rollout(dm.prompt_batch(0))
        r = b.rewards
        found = r > 0
        print(f"seed 1, T={temperature}, step 0: reward {r.mean():.3f}; sampled ids per episode: found "
              f"{b.loss_mask[found].sum(1).float().mean():.1f}, "
              f"not found {b.loss_mask[~found].sum(1).float().mean():.1f}")
        for name, adv, mode in [("GRPO (R - mu_G) / sigma_G, seq_mean_token_mean", group_advantages(r, 8),
                                 "seq_mean_token_mean"),
                                ("R - mean(R), seq_mean_token_sum (REINFORCE's)", r - r.mean(), "seq_mean_token_sum"),
                                ("R - mean(R), seq_mean_token_mean", r - r.mean(), "seq_mean_token_mean")]:
            w = aggregation_weights(b.loss_mask, mode)
            net = float((w * adv[:, None]).sum())
            total = float((w * adv[:, None].abs()).sum())
            print(f"    {name:48s} net weight on sampled tokens {net:+.4f} ({abs(net) / total:.3f} of sum |w A|)")


if __name__ == "__main__":
    main()
