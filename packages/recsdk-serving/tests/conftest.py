"""The publication the serving tests share: trained and published once per session, on 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_models import train_and_publish

from recsdk.data.testing import run_distributed


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A root of versions 0-4 (full at 0 and 4; row-wise, fp32) and the trained model's eval
    scores after each: ``(root, [(version, [scores per EVAL batch])])``."""
    root = tmp_path_factory.mktemp("published") / "pub"
    records = run_distributed(train_and_publish, 2, str(root), "row_wise", "float32")[0]
    return root, records
