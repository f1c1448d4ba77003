"""twell: activation sparsity in ReLU-gated FFNs as a one-line speedup.

    import twell
    model = twell.sparsify(model)          # rewrite sparse FFNs to twell ops
    twell.configure(model, route="prefill")  # each rewritten FFN's LayerConfig (route limits, layout)
    torch.compile(model, backend="twell")  # or through the compile backend
    twell.train.relufy(model)              # training sparse models: ReLU gates, the L1 penalty

Importing twell initialises no CUDA context, compiles no kernel and imports no transformers:
everything heavy loads on first use.
"""

from __future__ import annotations

import importlib

from twell.calibrate import calibrate
from twell.format import TwELL, pack, unpack
from twell.kernels.policy import LayerConfig
from twell.sparsify import compile_report, configure, layer_configs, report, restore, save_plan, sparsify, warmup

__version__ = "0.1.0"

# name -> (module, attribute), imported on first access. `sparsify`, `calibrate` and `report` are imported
# eagerly above: they share their names with submodules, and the import system sets a submodule as an
# attribute of this package when it is first imported, which would replace a lazily bound function.
_LAZY = {
    "ops": ("twell.ops", None),
    "train": ("twell.train", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'twell' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = [
    "TwELL",
    "pack",
    "unpack",
    "__version__",
    "calibrate",
    "sparsify",
    "LayerConfig",
    "configure",
    "layer_configs",
    "restore",
    "report",
    "compile_report",
    "save_plan",
    "warmup",
    *_LAZY,
]
