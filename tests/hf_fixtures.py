"""The reference Hugging Face fixtures of ../shared/fixtures/hf/, shared by the model-family tests."""

import os

import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared",
                        "fixtures", "hf")
FAMILIES = ("llama3", "qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3")


def fixture(family: str) -> str:
    """The fixture folder of `family`; a missing one fails the test (CI must have them)."""
    path = os.path.join(FIXTURES, family)
    if not os.path.isdir(path):
        pytest.fail(f"reference fixture {path} is missing (../shared/fixtures/hf must exist)")
    return path


def golden(family: str, what: str) -> np.ndarray:
    return np.load(os.path.join(fixture(family), "golden", f"{what}.npy"))
