"""The README's quickstart runs as written (on the real SmolLM2-135M), and its first screen gives the two commands a
fresh machine needs: the one that sets everything up and runs the demo, and the test command CI runs."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
from test_smollm2 import needs_wheel

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_the_first_screen_gives_the_setup_and_the_test_commands():
    first = README[: README.index("## Quickstart")]
    assert "pip install torch==2.13.0 && pip install -e \".[dev]\"" in first and "python -m hf_paged_cache.demo" in first
    assert "\n.venv/bin/python -m pytest -q\n" in first
    assert (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text().count(".venv/bin/python -m pytest -q\n")


@pytest.mark.slow
@needs_wheel
def test_the_quickstart_runs_as_written():
    block = re.search(r"## Quickstart\n\n```python\n(.*?)```", README, re.S).group(1)
    assert len(block.strip().splitlines()) <= 12
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README quickstart", "exec"), {})
    lines = printed.getvalue().strip().splitlines()
    assert lines[0].startswith("It is a truth universally acknowledged") and lines[-1].startswith("[[")
