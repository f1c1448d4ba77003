"""Every example script runs on the CPU, offline, and its own checks pass."""

import runpy
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("sparsify_hf_model.py", "logits match"),
        ("calibrate_and_save_plan.py", "re-applied after reloading: 4 FFNs rewritten, logits match"),
        ("compile_with_backend.py", "logits match"),
    ],
)
def test_example(script, expected, capsys):
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert expected in capsys.readouterr().out
