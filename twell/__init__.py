"""twell: activation sparsity in ReLU-gated FFNs as a one-line speedup.

    import twell
    model = twell.sparsify(model)          # rewrite sparse FFNs to twell ops
    torch.compile(model, backend="twell")  # or through the compile backend

Importing twell initialises no CUDA context, compiles no kernel and imports no transformers:
everything heavy loads on first use.
"""

from __future__ import annotations

import importlib

from twell.format import TwELL, pack, unpack

__version__ = "0.1.0"

# name -> (module, attribute), imported on first access. `twell.sparsify` is the function, not the
# module of the same name: the value is cached in this namespace, over the submodule attribute that
# the import system sets.
_LAZY = {
    "ops": ("twell.ops", None),
    "sparsify": ("twell.sparsify", "sparsify"),
    "restore": ("twell.sparsify", "restore"),
    "report": ("twell.sparsify", "report"),
    "save_plan": ("twell.sparsify", "save_plan"),
    "calibrate": ("twell.calibrate", "calibrate"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'twell' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


__all__ = ["TwELL", "pack", "unpack", "__version__", *_LAZY]
