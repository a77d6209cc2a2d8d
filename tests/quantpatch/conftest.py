"""Shared fixtures for the quantpatch API tests."""

import pytest

from quantpatch.cli_commands import load_eval_script


@pytest.fixture(scope="module")
def eval_attention():
    """``eval/fireq_ablation.py``'s ``fireq_attention`` (the evaluation-only attention with online CRS)."""
    return load_eval_script("fireq_ablation.py").fireq_attention
