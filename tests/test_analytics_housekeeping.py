"""What the notebook and the jobs leave behind is ignored and cleaned, and the notebook's extra
is separate from `dev`."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_analytics_dir_is_ignored() -> None:
    out = subprocess.run(
        ["git", "check-ignore", "analytics/rates/part-0.parquet", "analytics/rates.png"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == ["analytics/rates/part-0.parquet", "analytics/rates.png"]


def test_make_clean_removes_analytics(tmp_path: Path) -> None:
    if shutil.which("make") is None:
        pytest.skip("make not installed")
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    for d in ("analytics/rates", "data/log", ".venv/bin", "keep"):
        (tmp_path / d).mkdir(parents=True)
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "keep"]


def test_notebook_extra() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {e.split(">")[0].split("=")[0].strip() for e in extras["notebook"]}
    assert {"jupyterlab", "ipykernel"} <= names
    assert not any(e.startswith("jupyterlab") for e in extras["dev"])  # make test stays small
    assert "pip install -e '.[notebook]'" in (ROOT / "docs" / "spark.md").read_text()
