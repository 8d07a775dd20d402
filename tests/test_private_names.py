"""A name that starts with ``_`` is private to its package: no module imports one from another package.

Read from the source with ``ast`` (nothing is imported): every ``from rl_lightning.<module> import _name`` in the
package, the tests, the experiments and the docs' examples must come from a module of the importer's own package
(``rl_lightning/rollout/branching.py`` may import ``rl_lightning.rollout.strategies._Episodes``; a test may not
import ``rl_lightning.cli._anything``). A helper a test or another package needs is public.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SOURCES = ("rl_lightning/**/*.py", "tests/**/*.py", "experiments/*.py", "docs/examples/*.py")


def private_imports(path: Path, root: Path) -> list[str]:
    """``"<file>:<line>: <module>.<name>"`` for each private ``rl_lightning`` name ``path`` imports from another
    package."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("rl_lightning"):
            continue
        source_package = node.module.rpartition(".")[0]
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__") and source_package != package:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.module}.{alias.name}")
    return found


def test_no_module_imports_a_private_name_from_another_package():
    found = [hit for pattern in SOURCES for path in sorted(REPO.glob(pattern)) for hit in private_imports(path, REPO)]
    assert found == []


def test_the_check_finds_a_private_import_from_another_package_and_allows_one_within(tmp_path):
    (tmp_path / "rl_lightning" / "rollout").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    inside = tmp_path / "rl_lightning" / "rollout" / "branching.py"
    inside.write_text("from rl_lightning.rollout.strategies import GroupRollout, _Episodes\n")
    outside = tmp_path / "tests" / "test_x.py"
    outside.write_text("import os\nfrom rl_lightning.cli import _helper, cli_main\n"
                       "from rl_lightning import __version__\n")
    assert private_imports(inside, tmp_path) == []
    assert private_imports(outside, tmp_path) == ["tests/test_x.py:2: rl_lightning.cli._helper"]
