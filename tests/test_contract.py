"""The contract every registered method keeps, checked on each one by being registered.

A method is registered when ``rl_lightning.algorithms`` exports it and ``configs/`` ships a config whose
``model.class_path`` names it. For each, from its own config on a small batch:

* a 2-step fit changes the parameters;
* resuming from the step-1 checkpoint gives parameters bit-identical to the straight 2-step run;
* every scalar it logs is documented in docs/metrics.md;
* if it declares ``zero_advantage_rows_are_inert``, a zero-advantage row's loss is exactly 0 with zero gradient
  (what lets ``update`` skip such rows).
"""

from __future__ import annotations

import hashlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

import rl_lightning.algorithms as algorithms
from rl_lightning.algorithms import Advantages, RLModule
from rl_lightning.cli import build_cli
from tests.conftest import REPO

METHODS = sorted((getattr(algorithms, name) for name in algorithms.__all__
                  if inspect.isclass(getattr(algorithms, name)) and issubclass(getattr(algorithms, name), RLModule)
                  and getattr(algorithms, name) is not RLModule), key=lambda c: c.__name__)


def _configs() -> dict[str, Path]:
    found = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model", {})
        name = model.get("class_path", "").rsplit(".", 1)[-1]
        if name and model.get("init_args", {}).get("model_name_or_path", "embedded:arithmetic").startswith("embedded:"):
            found.setdefault(name, path)
    return found


CONFIGS = _configs()
SMALL = ["--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
         "--data.init_args.max_new_tokens=4"]


class _Names(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    name = property(lambda self: "names")
    version = property(lambda self: 0)

    def log_hyperparams(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.names |= set(metrics)


def _digest(module: RLModule) -> str:
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode() + param.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _fit(config: Path, root: Path, steps: int, ckpt_path: str | None = None) -> tuple[RLModule, _Names]:
    torch.manual_seed(0)
    cli = build_cli(["--config", str(config), f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}",
                     *SMALL], run=False, save_config=False)
    names = _Names()
    cli.trainer.loggers = [names]
    for cb in [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]:
        cli.trainer.callbacks.remove(cb)
    cli.trainer.callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli.model, names


def documented_names() -> tuple[set[str], set[str]]:
    """``(names, prefixes)`` of docs/metrics.md's table: each backticked name of a row's first cell, ``_low`` after a
    name standing for that name with the suffix, ``train/lr_<name>`` for the prefix ``train/lr_``."""
    names, prefixes = set(), set()
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        if not line.startswith("| `"):
            continue
        last = None
        for token in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if token.startswith("_") and last is not None:
                names.add(last + token)
            elif "<" in token:
                prefixes.add(token.split("<")[0])
            else:
                names.add(token)
                last = token
    return names, prefixes


def test_every_exported_method_is_registered_with_a_config():
    assert METHODS and {m.__name__ for m in METHODS} <= set(CONFIGS), sorted(
        {m.__name__ for m in METHODS} - set(CONFIGS))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.__name__)
def test_a_method_learns_resumes_exactly_and_documents_what_it_logs(method, tmp_path):
    config = CONFIGS[method.__name__]
    initial = _digest(build_cli(["--config", str(config), *SMALL], run=False, save_config=False).model)
    straight, names = _fit(config, tmp_path / "straight", 2)
    assert _digest(straight) != initial, "a 2-step fit left every parameter unchanged"
    step1 = sorted((tmp_path / "straight" / "ckpt").glob("*step=1.ckpt"))
    assert step1, sorted(p.name for p in (tmp_path / "straight" / "ckpt").iterdir())
    resumed, _ = _fit(config, tmp_path / "resumed", 2, ckpt_path=str(step1[0]))
    assert _digest(resumed) == _digest(straight), "resuming from step 1 changed the parameters"
    documented, prefixes = documented_names()
    missing = sorted(n for n in names.names if n not in documented and n != "epoch"
                     and not any(n.startswith(p) for p in prefixes))
    assert not missing, f"{method.__name__} logs scalars docs/metrics.md does not document: {missing}"


@pytest.mark.parametrize("method", [m for m in METHODS if m.zero_advantage_rows_are_inert], ids=lambda m: m.__name__)
def test_a_method_that_declares_zero_advantage_rows_inert_gives_them_zero_loss_and_gradient(method):
    cli = build_cli(["--config", str(CONFIGS[method.__name__]), *SMALL], run=False, save_config=False)
    from tests.rollout.rollout_helpers import fake_trainer

    module, dm = cli.model, cli.datamodule
    dm.trainer = fake_trainer(module)
    dm.setup("fit")
    module.policy.train()
    batch = dm.rollout(dm.prompt_batch(0))  # a rollout of the config's data settings (top-k, aux draws, ...)
    rows = torch.arange(min(2, batch.num_rows))
    mb = batch.select(rows)
    zero = Advantages(torch.zeros(mb.num_rows, 1))
    weights = module.loss_weights(mb)
    out = module.forward_policy(mb, extra_ids=module.extra_logprob_ids(mb))
    loss, _ = module.policy_loss(mb, out, zero, weights)
    for term, _ in module.extra_losses(mb, out, zero, weights):
        loss = loss + term
    assert loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    assert all(bool((g == 0).all()) for g in grads)
