"""Every ```python block of README.md runs as pasted.

The convention, stated at the top of README's tours:
  - each block runs on its own, in a fresh namespace (so each block has its
    own imports), here in a temporary working directory;
  - a block preceded (on the line just before its fence) by
    `<!-- not-run: REASON -->` is skipped, and REASON must be given;
  - a block that imports torch or transformers is skipped when that package
    is missing (a block importing flash_attn, which is built on torch, needs torch).
"""

from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.*?)\s*-->$")


def readme_blocks(text):
    """[(line number of the fence, heading above it, source, not-run reason or None)]."""
    blocks, lines = [], text.splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            start = i
            prev = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = NOT_RUN.match(prev)
            reason = m.group(1) if m else None
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"README.md:{start + 1}: unclosed ```python block")
            blocks.append((start + 1, heading, "\n".join(body) + "\n", reason))
        i += 1
    return blocks


with open(README, encoding="utf-8") as _f:
    BLOCKS = readme_blocks(_f.read())


def test_readme_has_python_blocks_and_reasons():
    assert len(BLOCKS) >= 6
    for line, _heading, _src, reason in BLOCKS:
        if reason is not None:
            assert reason, f"README.md:{line}: a not-run marker needs a reason"


def test_block_parser():
    text = "# A\n```python\nx = 1\n```\n\n<!-- not-run: needs a GPU -->\n```python\ny\n```\n"
    assert readme_blocks(text) == [(2, "A", "x = 1\n", None), (7, "A", "y\n", "needs a GPU")]


@pytest.mark.parametrize("line,heading,source,reason", BLOCKS, ids=[f"L{b[0]}" for b in BLOCKS])
def test_readme_block_runs(line, heading, source, reason, tmp_path, monkeypatch):
    if reason is not None:
        pytest.skip(f"README.md:{line} is marked not-run: {reason}")
    for mod in ("torch", "transformers"):
        if re.search(rf"^\s*(import|from)\s+[\w., ]*\b{mod}\b", source, re.MULTILINE):
            pytest.importorskip(mod)
    if re.search(r"^\s*(import|from)\s+[\w., ]*\bflash_attn\b", source, re.MULTILINE):
        pytest.importorskip("torch")  # attn_fast.flash_attn is built on torch tensors
    monkeypatch.chdir(tmp_path)  # a block may write files (np.savez ...)
    code = compile(source, f"README.md:{line} ({heading})", "exec")
    exec(code, {"__name__": "__readme__"})  # noqa: S102 - the project's own README
