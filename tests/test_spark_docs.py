"""docs/spark.md's Python snippet runs as written from a plain venv script, as a new user runs it.

The snippet is taken from the doc, saved as a file and run with the venv's Python in a directory
holding `./data`, with neither PYSPARK_PYTHON nor the venv on PATH -- what a new user has. Without
`register()` pointing Spark's Python workers at `sys.executable`, the workers are the system
`python3` and the read fails with `No module named 'cramjam'`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spark_helpers import JAVA_MISSING, LogWriter, mqtt_rec

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.spark, pytest.mark.slow]


def python_snippets(doc: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)


def test_spark_md_snippet_runs_from_a_plain_script(tmp_path: Path) -> None:
    if shutil.which("java") is None:
        pytest.skip(JAVA_MISSING)
    snippet = python_snippets(ROOT / "docs" / "spark.md")[0]
    assert "spark_analytics.register(spark)" in snippet and "./data" in snippet
    w = LogWriter(tmp_path / "data", {"sensors": 2})
    for i in range(7):
        w.append("sensors", i % 2, [mqtt_rec(f"sensors/d{i}/t", b"{}", f"d{i}", 0, 1_000 + i)])
    (tmp_path / "my_script.py").write_text(snippet)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != venv_bin)
    env["PYTHONPATH"] = str(ROOT)  # this checkout, not the one the venv was installed from
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    proc = subprocess.run(
        [sys.executable, "my_script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\|\s*sensors\|\s*7\|", proc.stdout), proc.stdout
