"""Shared pytest setup: the "paged" attention is registered once, and every test starts from a fixed seed."""

import pytest
import torch

from hf_paged_cache import register_paged_attention


@pytest.fixture(scope="session", autouse=True)
def _paged_attention_registered():
    register_paged_attention()


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
