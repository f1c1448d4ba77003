import subprocess
import sys

import twell


def test_import_is_light():
    """import twell must not initialise CUDA, import triton's compiler or transformers."""
    code = (
        "import sys, torch, twell\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
        "bad = [m for m in ('transformers', 'triton') if m in sys.modules]\n"
        "assert not bad, f'imported at import time: {bad}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_cli_version():
    result = subprocess.run([sys.executable, "-m", "twell.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0
    assert twell.__version__ in result.stdout
