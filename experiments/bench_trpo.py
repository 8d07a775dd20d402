"""TRPO update time with the Gauss-Newton Fisher products (the default) against the double-backward ones.

    OMP_NUM_THREADS=1 .venv/bin/python experiments/bench_trpo.py [--batches 2] [--repeats 3]

The workload is ``configs/trpo.yaml``'s: its model (the embedded warm start), its TRPO settings (δ, damping,
``cg_iters``, line search, ``fisher_subsample``) and real rollouts of its task and sampling settings (16 prompts
x G = 8, at most 6 new tokens), ``--batches`` batches drawn from the warm start. ``TRPO.update`` runs on each
batch outside a Trainer (with a plain SGD(lr=1), as in training; the weights are restored before every update,
untimed) with ``fisher_product`` = ``double_backward`` and ``gauss_newton``, alternating (the order flips every
repeat). Prints the median seconds per update over the repeats and the ratio, where the time of each
path goes (its forwards, the build of the first backward, the products), and, per batch, how far the
accepted steps of the two paths are apart next to how far the double-backward path's own step moves when its
products are perturbed by 1e-6 relative (CG amplifies float32 rounding in its last iterations).
"""

from __future__ import annotations

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
from torch.nn.utils import parameters_to_vector  # noqa: E402

import rl_lightning.algorithms.trpo as trpo  # noqa: E402
from rl_lightning.envs import ArithmeticTask  # noqa: E402
from rl_lightning.rollout import RolloutBatch, RolloutDataModule  # noqa: E402
from rl_lightning.rollout.settings import grouped  # noqa: E402

METHODS = ("double_backward", "gauss_newton")


class _Optimizer:
    """What ``update`` needs of Lightning's optimiser wrapper, around a plain SGD(lr=1)."""

    def __init__(self, params) -> None:  # noqa: ANN001
        self.optimizer = torch.optim.SGD(params, lr=1.0)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def build(batches: int) -> tuple[trpo.TRPO, list[RolloutBatch]]:
    config = yaml.safe_load((REPO_ROOT / "configs" / "trpo.yaml").read_text())
    torch.manual_seed(config.get("seed_everything", 0))
    module = trpo.TRPO(**config["model"]["init_args"])
    optimizer = _Optimizer(module.policy.parameters())
    module.optimizers = lambda: optimizer  # type: ignore[method-assign]
    data = dict(config["data"]["init_args"])
    task = ArithmeticTask(**data.pop("task")["init_args"])
    dm = RolloutDataModule(task=task, **grouped(data))
    dm.trainer = SimpleNamespace(lightning_module=module, global_rank=0, world_size=1, global_step=0)
    return module, [dm.rollout(dm.prompt_batch(step)) for step in range(batches)]


def run_update(module: trpo.TRPO, batch: RolloutBatch, state: dict, method: str) -> tuple[float, torch.Tensor, dict]:
    """Seconds of one ``update`` from ``state``, the parameter change and the metrics (weights restored)."""
    module.policy.load_state_dict(state)
    module.fisher_product = method
    params = module.trainable_parameters()
    before = parameters_to_vector(params).detach().clone()
    advantages = module.compute_advantages(batch).detach().unsqueeze(-1)
    weights = module.loss_weights(batch)
    start = time.perf_counter()
    stats = module.update(batch, advantages, weights)
    seconds = time.perf_counter() - start
    step = parameters_to_vector(params).detach() - before
    module.policy.load_state_dict(state)
    return seconds, step, {k: float(v[0]) for k, v in stats.items()}


def profile(module: trpo.TRPO, batch: RolloutBatch, state: dict, method: str) -> dict[str, list[float]]:
    """Seconds of one update's pieces: its forwards, the build of the products (the first backward with
    ``create_graph``), the products."""
    times: dict[str, list[float]] = {}
    builder = "fisher_vector_product" if method == "double_backward" else "gauss_newton_vector_product"
    exact, forward, shared = getattr(trpo, builder), module.vocab_logprobs, module.fisher_logits

    def timed(name, fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            times.setdefault(name, []).append(time.perf_counter() - start)
            return out
        return call

    setattr(trpo, builder, lambda *a, **k: timed("product", timed("build", exact)(*a, **k)))
    module.vocab_logprobs = timed("forward", forward)  # type: ignore[method-assign]
    module.fisher_logits = timed("forward", shared)  # type: ignore[method-assign]
    try:
        seconds, _, _ = run_update(module, batch, state, method)
    finally:
        setattr(trpo, builder, exact)
        del module.vocab_logprobs, module.fisher_logits
    times["total"] = [seconds]
    return times


def jittered_step(module: trpo.TRPO, batch: RolloutBatch, state: dict, level: float) -> torch.Tensor:
    """The double-backward path's step with every product multiplied by ``1 + level * N(0, 1)`` per entry."""
    exact = trpo.fisher_vector_product
    gen = torch.Generator().manual_seed(0)

    def perturbed(kl, params, damping):  # noqa: ANN001, ANN202
        product = exact(kl, params, damping)
        return lambda v: (lambda out: out * (1 + level * torch.randn(out.shape, generator=gen, dtype=out.dtype)))(
            product(v))

    trpo.fisher_vector_product = perturbed
    try:
        return run_update(module, batch, state, "double_backward")[1]
    finally:
        trpo.fisher_vector_product = exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=2, help="real rollout batches of configs/trpo.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    module, batches = build(args.batches)
    state = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{sum(p.numel() for p in module.policy.parameters()) / 1e6:.2f}M params, cg_iters {module.cg_iters}, "
          f"fisher_subsample {module.fisher_subsample}; {len(batches)} batch(es) of "
          f"{batches[0].num_rows} rows x {batches[0].input_ids.shape[1]} positions "
          f"({batches[0].prompt_length} prompt), {sum(int(b.loss_mask.sum()) for b in batches)} generated tokens")

    run_update(module, batches[0], state, "gauss_newton")  # warm-up (allocator, first-call costs)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    steps: dict[str, list[tuple[torch.Tensor, dict]]] = {m: [] for m in METHODS}
    for r in range(args.repeats):
        for method in (METHODS if r % 2 == 0 else tuple(reversed(METHODS))):
            total = 0.0
            for i, batch in enumerate(batches):
                seconds, step, stats = run_update(module, batch, state, method)
                total += seconds
                if r == 0:
                    steps[method].append((step, stats))
            times[method].append(total / len(batches))
    old, new = (statistics.median(times[m]) for m in METHODS)
    print(f"\nseconds per update (median of {args.repeats} repeats, mean over the batches):")
    for method in METHODS:
        print(f"  {method:<16} {statistics.median(times[method]):7.3f}   (repeats: "
              + " ".join(f"{t:.3f}" for t in times[method]) + ")")
    print(f"  ratio gauss_newton / double_backward = {new / old:.3f}  ({old / new:.2f}x faster)")

    print("\none update on batch 0, where the time goes:")
    for method in METHODS:
        pieces = profile(module, batches[0], state, method)
        rest = pieces["total"][0] - sum(sum(pieces[k]) for k in ("forward", "build", "product"))
        print(f"  {method:<16} total {pieces['total'][0]:.3f} s = {len(pieces['forward'])} forwards "
              f"{sum(pieces['forward']):.3f} s, build {sum(pieces['build']):.3f} s, {len(pieces['product'])} "
              f"products {sum(pieces['product']):.3f} s ({statistics.mean(pieces['product']):.3f} s each), rest "
              f"(surrogate gradient g, CG vectors, line-search KL) {rest:.3f} s")

    print("\nper batch: |step_gn - step_db| / |step_db| next to the double-backward step under 1e-6 relative "
          "product noise, line-search steps, KL after the step")
    for i, batch in enumerate(batches):
        (db, db_stats), (gn, gn_stats) = steps["double_backward"][i], steps["gauss_newton"][i]
        noise = jittered_step(module, batch, state, 1e-6)
        print(f"  batch {i}: {float((gn - db).norm() / db.norm()):.2e} (noise yardstick "
              f"{float((noise - db).norm() / db.norm()):.2e}); k {db_stats['train/line_search_steps']:.0f} / "
              f"{gn_stats['train/line_search_steps']:.0f}; KL {db_stats['train/kl_after_step']:.6f} / "
              f"{gn_stats['train/kl_after_step']:.6f}; surrogate gain {db_stats['train/surrogate_improvement']:.5f}"
              f" / {gn_stats['train/surrogate_improvement']:.5f}")


if __name__ == "__main__":
    main()
