"""Calibration: measure each FFN's activation sparsity, decide where twell pays, and save the decisions.

    candidates = twell.passes.find_ffns(model)
    decisions = twell.calibrate(model, candidates, batches)   # {Candidate.path: Decision}
    save_plan(decisions, candidates, "plan.json"); load_plan("plan.json", candidates)

Measurement: forward hooks on each candidate's ``gate_module`` (the linear whose output, the
pre-activation, is thresholded; for one expert of a mixture-of-experts layer, the experts module, whose
call gives that expert's pre-activation through the candidate's ``measure``) count, per call, the
entries that survive ``not (h <= threshold)``:
nonzeros per row, per (row, tile) for each candidate tile width, per neuron. Prefill-shaped calls
(many tokens per sequence) and decode-shaped calls (one token per sequence, from a few greedy cached
decode steps after each batch) are kept apart. Separately, the model and each FFN module (on the inputs
it received) are timed on the first batch, for the FFN share of model time.

Decision, per layer: the TwELL layout (tile width, slots) with the fewest slots per column whose overflow
rows stay under ``max_overflow``; then, per phase, the cost model's predicted FFN speedup at the
phase's measured density and tokens per call, for the layer as it would run: its LayerConfig
(Decision.layer_config: that layout, the default route limits, and sparsify's layer_config changes),
routed by twell.kernels.policy.route as the dispatcher routes it; rewrite when either phase's
prediction reaches ``min_speedup``. A phase of a rewritten layer predicted slower than dense runs
dense (Decision.dense_phases: its route limits turned off). A rewritten layer runs with that same
LayerConfig.

Sharded models (FSDP2, tensor parallelism; every rank calls calibrate): a column-wise sharded gate's
slices are gathered, so each layer is measured over all its neurons (tiles counted within each rank's
slice, as the kernels run them; the cost model sees the width one rank runs); FFNs are not timed on
their own; and rank 0's decisions are broadcast, so every rank rewrites the same layers.

Cost models:

- ``AnalyticCostModel`` (CPU, or no GPU): documented fits. Calls the dispatcher runs dense
  (twell.kernels.policy.route with the layer's LayerConfig: too few tokens for prefill, K too wide,
  density past its dense_above, by default 0.8%, 0.7% from K=4096) have ratio 1. Prefill calls: the twell/dense time
  ratio is ``a + b * density``, fitted to twell's own kernels on an H200 (benchmarks/NOTES.md, K=2048,
  N=5632, 131072 tokens: ratio 0.83 at 0.5% density, mean of two timings 0.78 and 0.88; 1.00 at 1%).
  The fit is for K=2048: at K=4096, N=14336 the measured ratio at 0.5% is 0.95 (1.05x), so it is
  optimistic for wider models. Decode calls: the same form with intercept and slope measured at one
  token and at 16 (``AnalyticCostModel.decode_one`` / ``decode_16``), linear in log2(tokens) between.
  With the default ``min_speedup`` of 1.05, layers at or under 0.8% are rewritten for prefill, and
  layers up to several percent for their decode steps. On the CPU twell runs plain PyTorch, so this
  predicts GPU behaviour, not CPU time.
- ``BenchmarkCostModel`` (CUDA): times dense PyTorch against ``torch.ops.twell.*`` at the layer's shape
  and measured density (synthetic inputs: a gate threshold at the normal quantile that keeps that
  density) with the layer's LayerConfig, cached on disk per GPU name / dtype / shape / density bucket
  / LayerConfig. The timer is injectable, so
  the model is testable without a GPU.

The package, one module a role: config (CalibrationConfig, PHASES), hooks (the statistics hooks and
their counters), costs (the cost models), timing (the CUDA timers the benchmark cost model and the
benchmarks share), decisions (Decision and the rule that makes one), running (running the model:
calibrate itself) and plans (plan files).
"""

from twell.calibrate.config import PHASES, CalibrationConfig
from twell.calibrate.costs import AnalyticCostModel, BenchmarkCostModel, CostModel, resolve_cost_model
from twell.calibrate.decisions import Decision, layer_changes, predicted_model_speedup
from twell.calibrate.plans import load_plan, read_plan, save_plan
from twell.calibrate.running import calibrate
from twell.calibrate.timing import cuda_graph_time, cuda_median_time

__all__ = [
    "PHASES",
    "CalibrationConfig",
    "CostModel",
    "AnalyticCostModel",
    "BenchmarkCostModel",
    "Decision",
    "calibrate",
    "cuda_graph_time",
    "cuda_median_time",
    "layer_changes",
    "load_plan",
    "predicted_model_speedup",
    "read_plan",
    "resolve_cost_model",
    "save_plan",
]
