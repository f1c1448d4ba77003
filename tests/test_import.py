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


def test_calibrate_sparsify_and_report_stay_functions():
    """twell.calibrate, twell.sparsify and twell.report share their names with submodules: loading those
    (as sparsify does when given calibration data) must not replace the public functions, in a fresh
    interpreter."""
    code = (
        "import torch, twell\n"
        "from torch.nn import Linear, ReLU, Sequential\n"
        "model = Sequential(Sequential(Linear(4, 8), ReLU(), Linear(8, 4)))\n"
        "twell.sparsify(model, calibration_data=[{'input': torch.randn(2, 4)}], config={'progress': False})\n"
        "print(twell.report(model))\n"
        "import twell.calibrate, twell.sparsify, twell.report\n"
        "from twell.calibrate import calibrate\n"
        "from twell.sparsify import report, sparsify\n"
        "assert twell.calibrate is calibrate, twell.calibrate\n"
        "assert twell.sparsify is sparsify, twell.sparsify\n"
        "assert twell.report is report, twell.report\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_train_is_a_lazy_attribute():
    """twell.train loads on first access, and loading it imports neither transformers nor the passes."""
    code = (
        "import sys, twell\n"
        "assert 'twell.train' not in sys.modules\n"
        "assert callable(twell.train.l1_penalty) and callable(twell.train.relufy)\n"
        "bad = [m for m in ('transformers', 'triton', 'twell.passes') if m in sys.modules]\n"
        "assert not bad, f'imported by twell.train: {bad}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
