"""Shared fixtures for the quantpatch API tests."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eval_attention():
    """``eval/fireq_ablation.py``'s ``fireq_attention`` (the evaluation-only attention with online CRS)."""
    name = "_quantpatch_eval_fireq_ablation"
    spec = importlib.util.spec_from_file_location(name, ROOT / "eval" / "fireq_ablation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module.fireq_attention
    finally:
        sys.modules.pop(name, None)
