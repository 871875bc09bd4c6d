"""The README's API example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_api_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    result = subprocess.run([sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    # Hand computation (seq-mean-token-mean, fake log_probs = -0.1 * position, loss = -lp * adv):
    # seq 1: (0.2 + 0.3) / 2 = 0.25; seq 2: (-0.1 - 0.2) / 2 = -0.15; seq 3: (0.6 + 0.8) / 2 = 0.7.
    assert "2 micro-batches, global loss 0.2667" in result.stdout


def test_readme_engine_example_runs():
    """The second block continues the first (same names) with the FSDP engine."""
    text = (ROOT / "README.md").read_text()
    first, second = re.findall(r"```python\n(.*?)```", text, flags=re.S)[:2]
    result = subprocess.run([sys.executable, "-c", first + second], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert re.search(r"loss \d+\.\d+, grad norm \d+\.\d+", result.stdout), result.stdout
