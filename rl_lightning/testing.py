"""``check_method``: the contract every method keeps, runnable on any class, the library's or your own.

    from rl_lightning.testing import check_method

    report = check_method("configs/my_method.yaml", extra_metrics={"train/my_term"})   # raises ContractError

From the method's config (plus ``args``, command-line style), on a small batch
(``--data.init_args.sampling.max_new_tokens 4``, no logger, no evaluation), it checks that

* a 2-step fit changes the parameters (``learns``);
* resuming from the step-1 checkpoint gives parameters bit-identical to the straight 2-step run (``resumes``);
* every scalar the run logs is documented: in ``docs/metrics.md`` of a source checkout of rl_lightning, or among
  ``extra_metrics`` (``documented``; skipped, and said so in ``notes``, without a source checkout);
* if the class declares ``zero_advantage_rows_are_inert``, a zero-advantage row's loss is exactly 0 with zero
  gradient, which is what lets ``update`` skip such rows (``inert_rows``).

The library's own methods are held to it by ``tests/test_contract.py``, which calls this function.
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Iterable, Sequence

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from rl_lightning.algorithms import Advantages, RLModule

#: settings that make the check small (appended after the caller's ``args``)
SMALL = ("--trainer.logger=false", "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
         "--data.init_args.sampling.max_new_tokens=4")
#: docs/metrics.md of a source checkout (absent from an installed wheel)
METRICS_DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


class ContractError(AssertionError):
    """A method broke the contract; the message says which part and how."""


@dataclass
class ContractReport:
    """What ``check_method`` checked (each ``True`` passed; ``None``: not applicable or not checkable here)."""

    method: str
    learns: bool = False
    resumes: bool = False
    documented: bool | None = None
    inert_rows: bool | None = None
    logged: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)


class _Names(Logger):
    """Collects the names of every logged scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    name = property(lambda self: "names")
    version = property(lambda self: 0)

    def log_hyperparams(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.names |= set(metrics)


def parameter_digest(module: RLModule) -> str:
    """SHA-256 of every parameter's name and bytes: equal digests mean bit-identical parameters."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(name.encode() + param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def documented_metrics(path: Path = METRICS_DOC) -> tuple[set[str], set[str]]:
    """``(names, prefixes)`` of a metrics table like docs/metrics.md's: each backticked name of a row's first
    cell, ``_low`` after a name standing for that name with the suffix, ``train/lr_<name>`` for the prefix
    ``train/lr_``."""
    names, prefixes = set(), set()
    for line in path.read_text().splitlines():
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


def _build(config: Path, args: Sequence[str], extra: Sequence[str] = ()):  # noqa: ANN202
    from rl_lightning.cli import build_cli  # the top level: imported when a check runs

    return build_cli(["--config", str(config), *args, *SMALL, *extra], run=False, save_config=False)


def _fit(config: Path, args: Sequence[str], root: Path, steps: int,
         ckpt_path: str | None = None) -> tuple[RLModule, _Names]:
    torch.manual_seed(0)
    cli = _build(config, args, [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={root}"])
    names = _Names()
    cli.trainer.loggers = [names]
    for cb in [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]:
        cli.trainer.callbacks.remove(cb)
    cli.trainer.callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli.model, names


def check_inert_rows(config: Path, args: Sequence[str] = ()) -> None:
    """A zero-advantage row's loss (with every ``extra_losses`` term) is exactly 0 with zero gradient, on one
    rollout of the config's data settings. Raises ``ContractError`` otherwise."""
    cli = _build(config, args)
    module, data = cli.model, cli.datamodule
    data.trainer = SimpleNamespace(lightning_module=module, global_rank=0, world_size=1)  # what setup reads
    data.setup("fit")
    module.check_datamodule(data)  # what the module reads from the data settings (as its own setup does)
    module.policy.train()
    batch = data.rollout(data.prompt_batch(0))
    rows = batch.select(torch.arange(min(2, batch.num_rows)))
    zero = Advantages(torch.zeros(rows.num_rows, 1))
    weights = module.loss_weights(rows)
    out = module.forward_policy(rows, extra_ids=module.extra_logprob_ids(rows))
    loss, _ = module.policy_loss(rows, out, zero, weights)
    for term, _ in module.extra_losses(rows, out, zero, weights):
        loss = loss + term
    if loss.item() != 0.0:
        raise ContractError(f"{type(module).__name__} declares zero_advantage_rows_are_inert, but a zero-advantage "
                            f"row's loss is {loss.item()!r}")
    loss.backward()
    moved = [n for n, p in module.named_parameters() if p.grad is not None and not bool((p.grad == 0).all())]
    if moved:
        raise ContractError(f"{type(module).__name__} declares zero_advantage_rows_are_inert, but a zero-advantage "
                            f"row gives a gradient to {moved[:3]}")


def check_method(config: str | Path, args: Sequence[str] = (), extra_metrics: Iterable[str] = (),
                 workdir: str | Path | None = None) -> ContractReport:
    """Run the contract's checks (see the module docstring) on the method ``config`` builds.

    Args:
        config: the method's YAML config (a module of your own is importable when it is on ``PYTHONPATH``).
        args: more command-line arguments, after the config (``["--model", "mypkg.MyMethod"]``, overrides).
        extra_metrics: the scalars your method adds, documented where your users read them.
        workdir: where the runs' checkpoints go (a temporary directory by default, removed after).

    Returns:
        The ``ContractReport``; raises ``ContractError`` at the first broken part.
    """
    config = Path(config)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="rl-lightning-contract-") as tmp:
            return check_method(config, args, extra_metrics, tmp)
    root = Path(workdir)
    initial = parameter_digest(_build(config, args).model)
    straight, names = _fit(config, args, root / "straight", 2)
    report = ContractReport(type(straight).__name__, logged=set(names.names))
    if parameter_digest(straight) == initial:
        raise ContractError(f"{report.method}: a 2-step fit left every parameter unchanged")
    report.learns = True
    step1 = sorted((root / "straight" / "ckpt").glob("*step=1.ckpt"))
    if not step1:
        raise ContractError(f"{report.method}: no step-1 checkpoint was written")
    resumed, _ = _fit(config, args, root / "resumed", 2, ckpt_path=str(step1[0]))
    if parameter_digest(resumed) != parameter_digest(straight):
        raise ContractError(f"{report.method}: resuming from the step-1 checkpoint gave other parameters than the "
                            "straight 2-step run (state missing from the checkpoint, or randomness not seeded)")
    report.resumes = True
    if METRICS_DOC.is_file():
        documented, prefixes = documented_metrics()
        documented |= set(extra_metrics)
        missing = sorted(n for n in names.names if n not in documented and n != "epoch"
                         and not any(n.startswith(p) for p in prefixes))
        if missing:
            raise ContractError(f"{report.method} logs scalars that are not documented: {missing} (docs/metrics.md, "
                                "or extra_metrics)")
        report.documented = True
    else:
        report.notes.append(f"metric names not checked: {METRICS_DOC} is not here (an installed wheel)")
    if straight.zero_advantage_rows_are_inert:
        check_inert_rows(config, args)
        report.inert_rows = True
    return report
