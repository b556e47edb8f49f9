"""The tutorial's outputs are today's: regenerating them (docs/tools/generate_outputs.py) must
leave docs/tutorial.md unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_outputs",
                                                  ROOT / "docs" / "tools" / "generate_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tutorial_outputs_are_regenerated_unchanged():
    gen = _generator()
    text = gen.TUTORIAL.read_text()
    assert "<!-- gen:" in text and "```console\n$ holmes-sim" in text
    assert gen.regenerate(text) == text, (
        "docs/tutorial.md differs from the current version's outputs; run "
        "python docs/tools/generate_outputs.py and review the diff")
