"""The README's snippets run as written: the CPU quickstart everywhere, the GPU ones (torch, jax,
cupy) on a GPU. Each block follows a `<!-- readme-test: KIND -->` line."""

import pathlib
import re
import subprocess
import sys

import pytest

import pinstage

README = pathlib.Path(__file__).parents[2] / "README.md"
BLOCKS = re.findall(r"<!-- readme-test: (\w+) -->\s*```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_its_snippets():
    assert [k for k, _ in BLOCKS] == ["cpu", "torch", "jax", "cupy", "cpu", "cpu"]


def _run(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"snippet failed:\n{code}\n--- stderr ---\n{r.stderr[-3000:]}"


@pytest.mark.child_process
@pytest.mark.parametrize("code", [c for k, c in BLOCKS if k == "cpu"])
def test_cpu_snippet(code):
    _run(code)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,code", [(k, c) for k, c in BLOCKS if k != "cpu"], ids=lambda x: x if len(x) < 8 else "")
def test_gpu_snippet(gpu, kind, code):
    pytest.importorskip(kind)
    _run(code)
