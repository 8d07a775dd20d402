"""The shape of the core, for a redesign's before/after: lines per file, the hooks each method overrides, and
the import structure.

    .venv/bin/python experiments/core_shape.py                       # this checkout
    PYTHONPATH=<other checkout> .venv/bin/python experiments/core_shape.py

For every algorithm exported by ``rl_lightning.algorithms``: its base classes up to ``RLModule`` (the depth),
and each name its class and its ancestors below ``RLModule`` define that ``RLModule`` (or
``lightning.LightningModule``) also defines: the hooks and class flags it overrides. Then the import circles
and upward imports (``../shared/tools/imports.py`` when it is there).
"""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path


def main() -> None:
    import rl_lightning
    import rl_lightning.algorithms as algorithms
    from lightning.pytorch import LightningModule

    from rl_lightning.algorithms import RLModule

    root = Path(rl_lightning.__file__).parent
    print(f"rl_lightning at {root}")
    print("\n## lines per file")
    for path in sorted(root.rglob("*.py")):
        print(f"{len(path.read_text().splitlines()):5d}  {path.relative_to(root.parent)}")
    base_names = set(vars(RLModule)) | set(vars(LightningModule))
    print("\n## methods: depth below RLModule, overridden hooks and flags")
    for name in sorted(algorithms.__all__):
        cls = getattr(algorithms, name)
        if not inspect.isclass(cls) or not issubclass(cls, RLModule) or cls is RLModule:
            continue
        chain = [k for k in cls.__mro__ if issubclass(k, RLModule) and k is not RLModule]
        overridden = sorted({attr for k in chain for attr in vars(k)
                             if attr in base_names and not attr.startswith("__")})
        print(f"{name:16s} depth {len(chain)}  ({' -> '.join(k.__name__ for k in chain)} -> RLModule)")
        print(f"{'':16s} {len(overridden)} overridden: {', '.join(overridden)}")
    tool = Path(__file__).resolve().parents[2] / "shared" / "tools" / "imports.py"
    if tool.exists():
        print("\n## imports")
        sys.stdout.flush()
        subprocess.run([sys.executable, str(tool), str(root)], check=False)


if __name__ == "__main__":
    main()
