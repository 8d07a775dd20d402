"""Run torch single-threaded in these tests: the models are tiny, and with intra-op threads a busy CPU
(other processes) makes every small matmul wait for a free core -- 100x slower. Restored after each test."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
