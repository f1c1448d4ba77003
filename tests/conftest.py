"""Test setup: without a CUDA GPU, Triton kernels run through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before triton is first imported, hence here and at import time.

Inductor's cache is kept per version of twell's sources: its key does not cover a custom op's schema, so a
graph compiled before an op argument was removed would otherwise be loaded and call the op with it.
"""

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_SOURCES = sorted((Path(__file__).resolve().parents[1] / "twell").rglob("*.py"))
_VERSION = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES)).hexdigest()[:12]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"twell-inductor-{_VERSION}"))

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_language_once_a_launch() -> None:
    """Triton's interpreter (3.x) points triton.language at its interpreted ops when a kernel launches,
    and again, never undone, on every call of a @triton.jit helper inside it (`_patch_lang`): ~3 ms a
    call, over a third of the suite's time. Within a launch, a helper whose module sees only language
    modules patched already (by the launch, or by an earlier helper: those patches last the launch)
    skips the repeat; any other call, and every launch, patches as before. Nothing changes where the
    interpreter has no `_patch_lang`."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # no Triton here: nothing to interpret
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:
        return

    patched = []  # the running launch's patched language modules (ids)

    @functools.cache
    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    class Launch:
        def __init__(self, scope, ids):
            self.scope = scope
            patched.append(set(ids))

        def restore(self):
            patched.pop()
            self.scope.restore()

    class Kept:  # a helper's scope: nothing of its own to restore
        def restore(self):
            pass

    def patch_once(fn):
        ids = langs(fn)
        if not patched:  # a launch: restored when it ends
            return Launch(patch(fn), ids)
        if not ids <= patched[-1]:  # a helper seeing a module not patched yet
            patch(fn)  # its scope is never restored by the interpreter: patched for the launch
            patched[-1] |= ids
        return Kept()

    interpreter._patch_lang = patch_once


_patch_language_once_a_launch()

DEVICE = "cuda" if HAS_CUDA else "cpu"


# `slow`: combinations of a parametrized test that repeat branches its other cases already take (slow in
# Triton's interpreter). Skipped on the CPU unless TWELL_SLOW=1 (`make test-all`); a GPU runs them.
RUN_SLOW = HAS_CUDA or os.environ.get("TWELL_SLOW") == "1"


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_slow = pytest.mark.skip(reason="slow: set TWELL_SLOW=1 to run")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
        elif "slow" in item.keywords and not RUN_SLOW:
            item.add_marker(skip_slow)


def slow_unless(keep: bool, *values, id: str):
    """pytest.param(*values, id=id), marked `slow` unless `keep`."""
    return pytest.param(*values, id=id, marks=() if keep else pytest.mark.slow)


@pytest.fixture
def device():
    return DEVICE


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN anywhere gives NaN, which fails any tolerance)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def compile_for_hopper(script: str, tmp_path) -> None:
    """Run `script` (it builds kernels for sm_90 with Triton's compiler and ptxas and checks their
    resources) in a fresh interpreter-free process on this tree's twell, whatever PYTHONPATH says; skip
    where Triton has no NVIDIA toolchain, and on a GPU (its tests build the kernels for real, and older
    Tritons differ in these APIs)."""
    import triton

    if not (Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump").exists():
        pytest.skip("this Triton build has no NVIDIA toolchain")
    if HAS_CUDA:
        pytest.skip("a GPU compiles the kernels in the tests below")
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
