"""Calibration statistics, decisions, cost models and plans, on hand-built FFNs with known activations.

The candidates here are built by hand (the fields of twell.passes' Candidate), so these tests pin the
statistics independently of the matcher; tests/test_cli.py runs the real matcher end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import twell
from twell.calibrate import (
    AnalyticCostModel,
    BenchmarkCostModel,
    CalibrationConfig,
    Decision,
    calibrate,
    load_plan,
    predicted_model_speedup,
    save_plan,
)
from twell.calibrate.decisions import HOT_MIN_ROWS
from twell.kernels import policy
from twell.kernels.policy import LayerConfig


@dataclass
class Candidate:
    path: str
    gate_module: nn.Module | None
    hidden_size: int
    model_size: int
    kind: str = "gated"
    activation: str = "relu"
    rewritable: bool = True
    reason: str = ""
    gate_slice: slice | None = None
    threshold: float = 0.0
    measure: object = None


class GatedFFN(nn.Module):
    """down(relu_t(gate(x)) * up(x)); with fused=True, gate and up are one linear (gate first)."""

    def __init__(self, k: int, n: int, *, identity_gate: bool = False, fused: bool = False, threshold: float = 0.0):
        super().__init__()
        self.n, self.fused, self.threshold = n, fused, threshold
        if fused:
            self.gate_up = nn.Linear(k, 2 * n, bias=False)
        else:
            self.gate = nn.Linear(k, n, bias=False)
            self.up = nn.Linear(k, n, bias=False)
            if identity_gate:  # the pre-activation is the input itself: statistics are known exactly
                with torch.no_grad():
                    self.gate.weight.copy_(torch.eye(n, k))
        self.down = nn.Linear(n, k, bias=False)

    def forward(self, x):
        if self.fused:
            g, u = self.gate_up(x).split(self.n, dim=-1)
        else:
            g, u = self.gate(x), self.up(x)
        return self.down(torch.where(g > self.threshold, g, 0.0) * u)


class Stack(nn.Module):
    """Takes pre-built float inputs (a dict batch {"x": ...}) through FFN blocks with residuals."""

    def __init__(self, *blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def candidate_of(model: Stack, i: int, **kw) -> Candidate:
    block = model.blocks[i]
    gate = block.gate_up if block.fused else block.gate
    return Candidate(f"blocks.{i}", gate, block.n, gate.in_features, **kw)


def sparse_input(m: int, n: int, density: float, seed: int = 0) -> torch.Tensor:
    """[m, n] with about `density` positive entries (the rest negative), skewed towards low columns."""
    gen = torch.Generator().manual_seed(seed)
    rates = density * n * torch.linspace(2, 0, n).clamp(min=0) / torch.linspace(2, 0, n).sum()
    positive = torch.rand(m, n, generator=gen) < rates
    magnitude = torch.rand(m, n, generator=gen) + 0.1
    return torch.where(positive, magnitude, -magnitude)


FAST = {"progress": False, "timing_repeats": 0}


def reference_stats(h: torch.Tensor, threshold: float, tile_n: int, slots: int) -> dict:
    """Statistics through twell.format.pack: an independent implementation of the same counts."""
    t = twell.pack(h, tile_n=tile_n, slots=slots, threshold=threshold)
    nnz = t.nnz_per_row()
    return {
        "density": t.stats()["density"],
        "mean": nnz.double().mean().item(),
        "max": int(nnz.max()),
        "p50": int(nnz.sort().values[math.ceil(0.5 * len(nnz)) - 1]),
        "p99": int(nnz.sort().values[math.ceil(0.99 * len(nnz)) - 1]),
        "max_per_tile": int(t.counts.max()),
        "overflow": t.overflow_rows.numel() / h.shape[0],
        "dead": int((~(h > threshold)).all(dim=0).sum()),
    }


@pytest.mark.parametrize("threshold", [0.0, 0.3], ids=["relu", "fatrelu0.3"])
@pytest.mark.parametrize("n", [200, 256], ids=["N200", "N256"])
def test_statistics_match_format_pack(n, threshold):
    """Density, nnz/row percentiles, per-tile maxima, overflow rows and dead neurons, N not a multiple
    of the tile included, against twell.pack on the very same pre-activations."""
    model = Stack(GatedFFN(n, n, identity_gate=True, threshold=threshold))
    h = torch.cat([sparse_input(300, n, 0.05, seed=1), sparse_input(1, n, 0.9, seed=2)])  # one dense row
    h[:, -7:] = -1.0  # dead neurons
    batches = [{"x": h[:150].view(3, 50, n)}, {"x": h[150:].unsqueeze(0)}]
    config = {**FAST, "layouts": [(t, t // share) for t in (64, 128, 256) for share in (2, 4, 8)]}
    decision = calibrate(model, [candidate_of(model, 0, threshold=threshold)], batches, config=config)["blocks.0"]
    stats = decision.stats["prefill"]
    assert stats["rows"] == 301 and stats["calls"] == 2 and "decode" not in decision.stats

    for tile_n in (64, 128, 256):
        ref = reference_stats(h, threshold, tile_n, tile_n // 8)
        assert stats["max_nnz_per_tile"][str(tile_n)] == ref["max_per_tile"]
        if tile_n > n:  # a tile wider than the layer is no layout candidate
            assert str(tile_n) not in stats["overflow_rows"]
            continue
        for slots in (tile_n // 2, tile_n // 4, tile_n // 8):
            expected = reference_stats(h, threshold, tile_n, slots)["overflow"]
            assert stats["overflow_rows"][str(tile_n)][str(slots)] == pytest.approx(expected)
    ref = reference_stats(h, threshold, 256, 32)
    assert stats["density"] == pytest.approx(ref["density"])
    assert decision.density == pytest.approx(ref["density"])
    nnz = stats["nnz_per_row"]
    assert (nnz["mean"], nnz["p50"], nnz["p99"], nnz["max"]) == (
        pytest.approx(ref["mean"]),
        ref["p50"],
        ref["p99"],
        ref["max"],
    )
    assert decision.dead_neurons == ref["dead"] >= 7
    rates = (h > threshold).double().mean(0).sort().values
    for q, rate in stats["neuron_rates"].items():
        assert rate == pytest.approx(rates[max(1, math.ceil(float(q) * n)) - 1].item())
    assert stats["neuron_rates"]["0.0"] == 0.0 and stats["neuron_rates"]["1.0"] == rates[-1].item() > 0


def test_prefill_and_decode_calls_are_kept_apart():
    n = 64
    model = Stack(GatedFFN(n, n, identity_gate=True))
    prefill = sparse_input(2 * 16, n, 0.02, seed=3).view(2, 16, n)
    decode = torch.full((4, 1, n), 1.0)  # every neuron active: decode density 1
    decision = calibrate(model, [candidate_of(model, 0)], [{"x": prefill}, {"x": decode}], config=FAST)["blocks.0"]
    assert decision.stats["decode"]["density"] == 1.0
    assert decision.stats["decode"]["rows"] == 4 and decision.stats["decode"]["rows_per_call_median"] == 4
    assert decision.stats["prefill"]["rows"] == 32
    assert decision.stats["prefill"]["density"] == pytest.approx((prefill > 0).double().mean().item())
    assert decision.dead_neurons == 0


def test_fused_gate_up_is_sliced():
    """Only the gate half of a fused gate_up output counts: the up half is made all-positive."""
    k = n = 32
    block = GatedFFN(k, n, fused=True)
    with torch.no_grad():
        block.gate_up.weight.zero_()
        block.gate_up.weight[:n].copy_(torch.eye(n))
        block.gate_up.weight[n:, 0] = 1.0  # up = x[:, 0] > 0 for every neuron
    model = Stack(block)
    x = sparse_input(64, n, 0.1, seed=4)
    x[:, 0] = 5.0
    candidate = candidate_of(model, 0, gate_slice=slice(0, n))
    decision = calibrate(model, [candidate], [{"x": x}], config=FAST)["blocks.0"]
    assert decision.density == pytest.approx((x > 0).double().mean().item())


def test_gate_width_mismatch_is_reported():
    model = Stack(GatedFFN(32, 32, fused=True))
    bad = candidate_of(model, 0)  # no gate_slice: the hook sees 64 features for hidden_size 32
    with pytest.raises(ValueError, match="hidden_size=32"):
        calibrate(model, [bad], [{"x": torch.randn(4, 32)}], config=FAST)


def test_layout_choice_and_decision():
    n = 512
    model = Stack(*(GatedFFN(n, n, identity_gate=True) for _ in range(3)))
    sparse = sparse_input(256, n, 0.004, seed=5)
    # Rows with 40 actives in the first 128 columns: more than the 16 slots of (128, 8) in 5% of rows.
    clumpy = sparse.clone()
    clumpy[::20, :40] = 1.0
    dense = sparse_input(256, n, 0.6, seed=6)

    class Routed(Stack):  # each block sees its own pre-activations, whatever the residual stream holds
        def forward(self, x):
            for block, h in zip(self.blocks, (sparse, clumpy, dense), strict=True):
                block(h)
            return x

    routed = Routed(*model.blocks)
    candidates = [candidate_of(routed, i) for i in range(3)]
    decisions = calibrate(routed, candidates, [{"x": torch.zeros(1)}], config=FAST)
    assert (decisions["blocks.0"].tile_n, decisions["blocks.0"].slots) == (128, 16)  # the kernels' default
    assert decisions["blocks.0"].rewrite and decisions["blocks.0"].overflow_rows == 0.0
    assert decisions["blocks.0"].predicted_speedup["prefill"] > 1.2
    # 40 actives fit the 64 slots of (256, 64) or (128, 64); fewest slots a column first, then nearest 128.
    assert (decisions["blocks.1"].tile_n, decisions["blocks.1"].slots) == (256, 64)
    assert decisions["blocks.1"].overflow_rows <= 0.01
    assert not decisions["blocks.2"].rewrite and decisions["blocks.2"].tile_n is None
    assert "too dense" in decisions["blocks.2"].reason
    # A looser overflow limit accepts the clumpy layer's rows at (128, 16), which then run dense.
    loose = calibrate(routed, candidates, [{"x": torch.zeros(1)}], config={**FAST, "max_overflow": 0.1})
    assert (loose["blocks.1"].tile_n, loose["blocks.1"].slots) == (128, 16)
    assert loose["blocks.1"].overflow_rows == pytest.approx(13 / 256)


@pytest.mark.parametrize("hot_rate", [policy.HOT_RATE, None], ids=["hot", "no-hot"])
def test_hot_neurons_enter_the_prediction(hot_rate):
    """A layer 3.3% dense, most of it in 32 neurons that fire on every other token: with those computed
    densely (the prefill path's hot neurons) the rest is 0.2% dense and the layer pays; without, not."""
    model = Stack(GatedFFN(512, 512, identity_gate=True))
    x = sparse_input(2048, 512, 0.002, seed=4)
    x[::2, ::16] = 1.0  # 8 per 128-wide tile: no row overflows
    decision = calibrate(model, [candidate_of(model, 0)], [{"x": x}], config=FAST, layer_config={"hot_rate": hot_rate})
    decision = decision["blocks.0"]
    assert decision.stats["prefill"]["density"] > 0.03 and decision.overflow_rows == 0.0
    if hot_rate is None:
        assert not decision.rewrite and "hot_neurons" not in decision.stats["prefill"]
    else:
        assert decision.rewrite and decision.stats["prefill"]["hot_neurons"] == 32
        cold = decision.stats["prefill"]["density"] - int((x[:, ::16] > 0).sum()) / x.numel()
        expected = AnalyticCostModel().time_ratio(
            kind="gated", m=policy.PREFILL_MIN_M, k=512, n=512, density=cold, dtype=torch.float32
        )
        assert decision.predicted_speedup["prefill"] == pytest.approx(1 / (expected + 32 / 512))


@dataclass
class FixedCost:
    ratio: float
    name: str = "fixed"

    def time_ratio(self, **shape) -> float:
        return self.ratio


@pytest.mark.parametrize(("ratio", "rewrite"), [(0.9, True), (0.96, False), (1.5, False)])
def test_min_speedup_decides(ratio, rewrite):
    model = Stack(GatedFFN(64, 64, identity_gate=True))
    config = {**FAST, "cost_model": FixedCost(ratio)}
    decision = calibrate(model, [candidate_of(model, 0)], [{"x": sparse_input(8, 64, 0.01)}], config=config)["blocks.0"]
    assert decision.rewrite is rewrite
    assert decision.predicted_speedup["prefill"] == pytest.approx(1 / ratio)
    assert decision.cost_model == "fixed" and decision.min_speedup == 1.05
    density, verdict = decision.stats["prefill"]["density"], "reaching" if rewrite else "below"
    expected = f"predicted {1 / ratio:.2f}x (prefill, {density:.2%} dense), {verdict} the 1.05x threshold"
    assert decision.reason == expected


def test_not_rewritable_candidates_keep_their_reason_and_are_not_hooked():
    model = Stack(GatedFFN(16, 16), GatedFFN(16, 16))
    silu = candidate_of(model, 1, rewritable=False, activation="silu", reason="SiLU is not sparse")
    decisions = calibrate(model, [candidate_of(model, 0), silu], [{"x": torch.randn(2, 5, 16)}], config=FAST)
    assert decisions["blocks.1"].rewrite is False and decisions["blocks.1"].reason == "SiLU is not sparse"
    assert decisions["blocks.1"].stats == {} and decisions["blocks.0"].stats


def test_model_is_left_as_it_was():
    model = Stack(GatedFFN(16, 16)).train()
    x = torch.randn(3, 16)
    before = model(x)
    calibrate(model, [candidate_of(model, 0)], [{"x": x}], config={"progress": False})
    assert model.training
    assert not model.blocks[0].gate._forward_hooks and not model.blocks[0]._forward_pre_hooks
    assert not model.blocks[0]._forward_hooks
    assert torch.equal(model(x), before)


def test_no_progress_output_off_a_terminal(capsys):
    """The progress bar is on by default, but off a terminal (a log, a pipe, pytest's capture) a transient
    bar would leave only a blank line: nothing is written."""
    model = Stack(GatedFFN(16, 16))
    calibrate(model, [candidate_of(model, 0)], [{"x": torch.randn(3, 16)}] * 2, config={"timing_repeats": 0})
    assert capsys.readouterr() == ("", "")


def test_time_share_of_each_ffn():
    """The timed FFN modules take part of the model's time; a heavy non-FFN part lowers their share."""

    class WithAttention(Stack):
        def forward(self, x):
            for _ in range(20):
                x = x + torch.tanh(x @ x.transpose(-1, -2)) @ x * 1e-3
            return super().forward(x)

    model = WithAttention(GatedFFN(64, 64), GatedFFN(64, 64))
    config = {"progress": False, "timing_repeats": 2}
    decisions = calibrate(
        model, [candidate_of(model, i) for i in range(2)], [{"x": torch.randn(256, 64)}], config=config
    )
    shares = [d.time_share["prefill"] for d in decisions.values()]
    assert all(0 < s < 0.5 for s in shares), shares
    assert "decode" not in decisions["blocks.0"].time_share


def test_config_and_data_errors():
    model = Stack(GatedFFN(16, 16))
    candidates = [candidate_of(model, 0)]
    with pytest.raises(ValueError, match="unknown calibration option"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"tile_width": 64})
    with pytest.raises(ValueError, match="slots must be <= tile_n, got slots=128, tile_n=64"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"layouts": [(64, 128)]})
    # a layout the kernels cannot run is no candidate: the chosen one is what the layer's kernels run
    with pytest.raises(ValueError, match="need 16 <= tile_n <= 256, got 512"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"layouts": [(512, 64)]})
    with pytest.raises(ValueError, match="need a power-of-two slots, got 12"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"layouts": [(128, 12)]})
    with pytest.raises(ValueError, match=r"layouts must be \(tile_n, slots\) pairs, got 128"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"layouts": [128, 16]})
    with pytest.raises(ValueError, match="layouts must not be empty"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={"layouts": []})
    with pytest.raises(ValueError, match="empty"):
        calibrate(model, candidates, [], config=FAST)
    with pytest.raises(TypeError, match=r"batch 0 is a list: expected a token-id tensor \[batch, seq\] or a dict"):
        calibrate(model, candidates, [[1, 2, 3]], config=FAST)
    with pytest.raises(ValueError, match="cost_model"):
        calibrate(model, candidates, [{"x": torch.randn(2, 16)}], config={**FAST, "cost_model": "fast"})
    assert CalibrationConfig.coerce(CalibrationConfig(max_overflow=0.05)).max_overflow == 0.05


# --- cost models ------------------------------------------------------------------------------------


def test_analytic_model_reproduces_the_h200_measurements():
    """benchmarks/NOTES.md, H200, K=2048, N=5632, 131072 tokens: ratio 0.83 at 0.5%, 1.00 at 1% density."""
    model = AnalyticCostModel()
    for density, ratio in ((0.005, 0.83), (0.01, 1.00)):
        got = model.time_ratio(kind="gated", m=131072, k=2048, n=5632, density=density, dtype=torch.bfloat16)
        assert got == pytest.approx(ratio, abs=0.01)
    assert model.break_even_density() == pytest.approx(0.0100, abs=5e-4)
    assert model.break_even_density(1.05) < model.break_even_density()


def test_analytic_model_routes_with_the_layer_config():
    """Calls the layer's LayerConfig sends dense (too few tokens for its prefill_min_m, denser than its
    dense_above) cost what dense costs; the same call on a layer with other limits runs sparse."""
    model = AnalyticCostModel()
    shape = {"kind": "gated", "m": 4096, "k": 2048, "n": 5632, "dtype": torch.bfloat16}
    assert model.time_ratio(density=0.005, **shape, config=policy.DEFAULT) == 1.0  # 4096 < 16384 tokens
    early = LayerConfig(prefill_min_m=4096)
    assert model.time_ratio(density=0.005, **shape, config=early) == pytest.approx(0.83)
    assert model.time_ratio(density=0.009, **shape, config=early) == 1.0  # past dense_above (0.8%)
    assert model.time_ratio(density=0.009, **shape, config=early.replace(dense_above=0.01)) < 1.0
    # by width where dense_above is None: 0.75% is sparse at K=2048, dense from K=4096 (0.7%)
    assert model.time_ratio(density=0.0075, **shape, config=early) < 1.0
    assert model.time_ratio(density=0.0075, **(shape | {"k": 4096, "n": 14336}), config=early) == 1.0


def test_analytic_model_reproduces_the_decode_measurements():
    """H200, K=2048, N=5632, graph replays against the faster dense: one token 0.415-0.450 of dense at 0.5%
    (by pattern), 0.508 at 5% (ffn-20261201-131614.json); 16 tokens 0.81-0.84 at 0.5%, 0.90 at 1% (16
    tokens past 1% route dense); 64 tokens, forced to the decode kernels, 0.94-1.00 at 0.5%, 1.10 at 1%
    (ffn-20261201-114900.json)."""
    model = AnalyticCostModel()
    shape = {"kind": "gated", "k": 2048, "n": 5632, "dtype": torch.bfloat16}
    for m, density, low, high in (
        (1, 0.005, 0.415, 0.45),
        (1, 0.05, 0.49, 0.53),
        (16, 0.005, 0.8, 0.85),
        (16, 0.01, 0.86, 0.92),
    ):
        assert low <= model.time_ratio(m=m, density=density, **shape) <= high, (m, density)
    assert model.time_ratio(m=16, density=0.02, **shape) == 1.0  # the route: dense
    assert model.time_ratio(m=4, density=0.005, **shape) < model.time_ratio(m=8, density=0.005, **shape) < 0.83
    forced = {**shape, "config": LayerConfig().replace(route="decode")}
    assert 0.94 <= model.time_ratio(m=64, density=0.005, **forced) <= 1.06
    assert 1.04 <= model.time_ratio(m=64, density=0.01, **forced) <= 1.14


class PhaseCost(FixedCost):
    """ratio[0] for prefill-sized calls, ratio[1] for decode-sized ones."""

    def time_ratio(self, **shape) -> float:
        return self.ratio[shape["m"] <= policy.DECODE_SPARSE_MAX_M]


@pytest.mark.parametrize(
    ("ratios", "rewrite", "dense_phases"),
    [
        ((0.5, 1.25), True, ["decode"]),
        ((1.25, 0.5), True, ["prefill"]),
        ((0.99, 1.01), False, []),
        ((0.9, 1.0), True, []),
    ],
    ids=["prefill-pays", "decode-pays", "neither", "decode-even"],
)
def test_a_phase_slower_than_dense_runs_dense(ratios, rewrite, dense_phases):
    """Rewritten when either phase reaches min_speedup; a phase predicted slower than dense gets its
    route turned off in the layer's config, and its predicted speedup reads 1."""
    model = Stack(GatedFFN(32, 64, identity_gate=True))
    batches = [{"x": sparse_input(3 * 7, 32, 0.02).view(3, 7, 32)}, {"x": torch.ones(4, 1, 32)}]
    config = {**FAST, "cost_model": PhaseCost(ratios)}
    decision = calibrate(model, [candidate_of(model, 0)], batches, config=config)["blocks.0"]
    assert decision.rewrite is rewrite and decision.dense_phases == dense_phases
    speedups = {p: 1 / r for p, r in zip(("prefill", "decode"), ratios, strict=True)}
    best = max(speedups, key=speedups.get)
    assert decision.reason.startswith(f"predicted {speedups[best]:.2f}x ({best}, ")
    for phase in ("prefill", "decode"):
        slower = phase in dense_phases
        assert decision.predicted_speedup[phase] == pytest.approx(1.0 if slower else speedups[phase])
        assert (f"{phase} calls run dense (predicted {speedups[phase]:.2f}x)" in decision.reason) is slower
    layer = decision.layer_config()
    assert (layer.decode_max_m, layer.decode_sparse_max_m) == ((0, 0) if "decode" in dense_phases else (8, 16))
    assert layer.prefill_min_m == (None if "prefill" in dense_phases else policy.PREFILL_MIN_M)
    wide = dataclasses.replace(decision, model_size=4096).layer_config()  # its width's threshold
    assert wide.prefill_min_m == (None if "prefill" in dense_phases else 8192)
    assert decision.layer_config({"prefill_min_m": 4096}).prefill_min_m == 4096  # sparsify's changes come last
    assert Decision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision


class SizeCost(FixedCost):
    """ratio[m] for calls of m tokens (0.5 for prefill-sized ones); records the sizes it was asked for."""

    def __init__(self, ratio):
        super().__init__(ratio)
        self.asked = []

    def time_ratio(self, **shape) -> float:
        self.asked.append(shape["m"])
        return self.ratio.get(shape["m"], 0.5)


@pytest.mark.parametrize(
    ("ratios", "cap", "decode_limits", "decode_speedup"),
    [
        ({1: 0.5, 16: 1.25}, 1, (1, 1), 2 / (0.5 + 1)),  # 16 tokens lose: capped at 1, the 16s run dense
        ({1: 0.5, 16: 0.8}, None, (16, 16), 2 / (0.5 + 0.8)),  # both win: the calibrated reach
        ({1: 1.25, 16: 0.8}, None, (0, 0), 2 / (1.25 + 0.8)),  # the smallest loses: the phase, as a whole
        ({1: 1.25, 16: 1.25}, None, (0, 0), 0.8),  # both lose: the decode phase runs dense
    ],
    ids=["larger-loses", "both-win", "smallest-loses", "both-lose"],
)
def test_decode_phase_is_predicted_per_call_size(ratios, cap, decode_limits, decode_speedup):
    """Decode calls of 1 and 16 tokens (as many of each), 1% dense (K=32: the reach table sends 16 there):
    a larger size that loses caps the decode kernels at the sizes that win instead of turning off the
    one-token calls; 64-token calls (routed dense) get no prediction and count as dense."""
    model = Stack(GatedFFN(32, 64, identity_gate=True))
    batches = [{"x": sparse_input(3 * 7, 32, 0.02).view(3, 7, 32)}]
    batches += [{"x": sparse_input(b, 32, 0.01, seed=b).view(b, 1, 32)} for b in (1, 16)]
    cost = SizeCost(ratios)
    decision = calibrate(model, [candidate_of(model, 0)], batches, config={**FAST, "cost_model": cost})["blocks.0"]
    assert decision.rewrite and decision.decode_cap == cap
    layer = decision.layer_config()
    assert (layer.decode_max_m, layer.decode_sparse_max_m) == decode_limits
    assert ("decode" in decision.dense_phases) is (decode_limits == (0, 0))
    expected = 1.0 if decision.dense_phases else decode_speedup
    assert decision.predicted_speedup["decode"] == pytest.approx(expected)
    assert ("decode calls of more than 1 tokens run dense" in decision.reason) is (cap == 1)
    assert Decision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision

    batches.append({"x": sparse_input(64, 32, 0.01, seed=64).view(64, 1, 32)})
    cost = SizeCost({1: 0.5, 16: 0.8, 64: 9.0})  # 64 would lose: it must not be asked
    decision = calibrate(model, [candidate_of(model, 0)], batches, config={**FAST, "cost_model": cost})["blocks.0"]
    assert 64 not in cost.asked and decision.decode_cap is None
    assert decision.predicted_speedup["decode"] == pytest.approx(3 / (0.5 + 0.8 + 1))


def test_decode_calls_are_timed_as_graph_replays(tmp_path):
    """Decode-routed calls: both sides through graph_timer (the key says so); a capture that fails times
    both eagerly; prefill-sized calls are timed eagerly."""
    used = []

    def timer(name, seconds):
        return lambda fn: used.append(name) or fn() is not None and seconds

    cost = BenchmarkCostModel(
        device="cpu", timer=timer("eager", 1.0), graph_timer=timer("graph", 0.5), device_name="x", cache_dir=tmp_path
    )
    shape = {"kind": "gated", "k": 32, "n": 96, "density": 0.01, "dtype": torch.float32}
    assert cost.time_ratio(m=4, **shape) == 1.0 and used == ["graph", "graph"]
    assert cost.time_ratio(m=64, **shape, config=LayerConfig(prefill_min_m=64)) == 1.0
    assert used == ["graph", "graph", "eager", "eager"]
    cache = json.loads((tmp_path / "costs.json").read_text())
    assert sorted(entry["timing"] for entry in cache.values()) == ["eager", "graph"]
    assert [key.endswith("|graph") for key in sorted(cache, key=lambda k: "|M4|" not in k)] == [True, False]

    def failing(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    used.clear()
    eager = BenchmarkCostModel(
        device="cpu", timer=timer("eager", 1.0), graph_timer=failing, device_name="y", cache_dir=tmp_path
    )
    assert eager.time_ratio(m=2, **shape) == 1.0 and used == ["eager", "eager"]


def test_benchmark_cost_model_times_once_and_caches(tmp_path):
    calls = []

    def timer(fn):
        out = fn()  # the benchmarked callables really run (CPU reference ops here)
        assert out.shape == (64, 32) and torch.isfinite(out).all()
        calls.append(fn)
        return 2e-3 if len(calls) % 2 else 1e-3  # dense first, then twell: twell twice as fast

    shape = {"kind": "gated", "m": 50, "k": 32, "n": 96, "dtype": torch.float32}
    cost = BenchmarkCostModel(device="cpu", timer=timer, device_name="Fake GPU", cache_dir=tmp_path)
    assert cost.time_ratio(density=0.010, **shape) == pytest.approx(0.5)
    assert cost.time_ratio(density=0.0095, **shape) == pytest.approx(0.5)  # same density bucket, same M bucket
    assert len(calls) == 2
    cost.time_ratio(density=0.05, **shape)  # another bucket: measured
    assert len(calls) == 4

    cache = json.loads((tmp_path / "costs.json").read_text())
    assert len(cache) == 2 and all(key.startswith("Fake GPU|") and "|M64|K32|N96|" in key for key in cache)
    cost.time_ratio(density=0.01, **shape, config=LayerConfig(tile_n=64, slots=8))  # another layer config
    assert len(calls) == 6
    calls.clear()
    again = BenchmarkCostModel(device="cpu", timer=timer, device_name="Fake GPU", cache_dir=tmp_path)
    assert again.time_ratio(density=0.01, **shape) == pytest.approx(0.5) and len(calls) == 0
    other_gpu = BenchmarkCostModel(device="cpu", timer=timer, device_name="Other GPU", cache_dir=tmp_path)
    other_gpu.time_ratio(density=0.01, **{**shape, "kind": "plain"})
    assert len(calls) == 2


@pytest.mark.parametrize("kind", ["gated", "plain"])
def test_benchmark_cost_model_times_the_layer_as_it_runs(kind, tmp_path, monkeypatch):
    """The twell side runs with the layer's LayerConfig and a down weight laid out as sparsify lays it
    (in the nn.Linear layout the dispatcher would run it dense)."""
    seen = []
    op = getattr(twell.ops, f"{kind}_ffn" if kind == "gated" else "ffn")
    spy = lambda x, *weights, **kw: seen.append((weights[-1], kw["config"])) or op(x, *weights, **kw)
    monkeypatch.setattr(twell.ops, f"{kind}_ffn" if kind == "gated" else "ffn", spy)
    cost = BenchmarkCostModel(device="cpu", timer=lambda fn: fn() is not None, device_name="x", cache_dir=tmp_path)
    config = LayerConfig(tile_n=32, slots=4, prefill_min_m=64)
    cost.time_ratio(kind=kind, m=50, k=32, n=96, density=0.01, dtype=torch.float32, config=config)
    ((down_weight, used),) = seen
    assert used == config and down_weight.shape == (32, 96) and down_weight.t().is_contiguous()


def test_benchmark_inputs_have_the_requested_density(tmp_path):
    """The synthetic gate threshold keeps about `density` of the entries."""
    cost = BenchmarkCostModel(device="cpu", timer=lambda fn: 1.0, device_name="x", cache_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    pre = torch.randn(4096, 256, generator=gen) @ (torch.randn(256, 256, generator=gen) * 256**-0.5)
    for density in (0.005, 0.02, 0.1):
        threshold = float(torch.special.ndtri(torch.tensor(1 - cost.density_bucket(density), dtype=torch.float64)))
        assert (pre > threshold).double().mean().item() == pytest.approx(cost.density_bucket(density), rel=0.15)
    assert cost.density_bucket(0.01) == pytest.approx(0.01, rel=0.1)
    assert cost.tokens_bucket(1) == 1 and cost.tokens_bucket(257) == 512


def test_benchmark_tokens_sets_the_prefill_shape():
    seen = []

    class Recording(FixedCost):
        def time_ratio(self, **shape) -> float:
            seen.append((shape["m"], shape["k"], shape["n"], shape["kind"]))
            configs.append(shape["config"])
            return self.ratio

    configs = []
    model = Stack(GatedFFN(32, 64, identity_gate=True))
    batches = [{"x": sparse_input(3 * 7, 32, 0.02).view(3, 7, 32)}, {"x": torch.ones(5, 1, 32)}]
    decision = calibrate(model, [candidate_of(model, 0)], batches, config={**FAST, "cost_model": Recording(0.5)})
    assert seen == [(policy.PREFILL_MIN_M, 32, 64, "gated"), (5, 32, 64, "gated")]  # prefill at serving size
    # predicted for the layer as it will run: its chosen layout, the default route limits
    layout = decision["blocks.0"].tile_n, decision["blocks.0"].slots
    assert configs == [LayerConfig(*layout)] * 2 == [decision["blocks.0"].layer_config()] * 2
    seen.clear()
    config = {**FAST, "cost_model": Recording(0.5), "benchmark_tokens": 32768}
    calibrate(model, [candidate_of(model, 0)], batches, config=config)
    assert seen == [(32768, 32, 64, "gated"), (5, 32, 64, "gated")]
    seen.clear()
    configs.clear()
    # sparsify's layer_config reaches the prediction: prefill predicted from the layer's prefill_min_m
    calibrate(
        model,
        [candidate_of(model, 0)],
        batches,
        config={**FAST, "cost_model": Recording(0.5)},
        layer_config={"prefill_min_m": 4096},
    )
    assert seen == [(4096, 32, 64, "gated"), (5, 32, 64, "gated")]
    assert configs == [LayerConfig(*layout, prefill_min_m=4096)] * 2


@pytest.mark.gpu
def test_benchmark_cost_model_on_the_gpu(tmp_path):
    """Real timings on the GPU: cached, and twell's advantage shrinks as the density grows."""
    cost = BenchmarkCostModel(cache_dir=tmp_path)
    shape = {"kind": "gated", "m": 16384, "k": 2048, "n": 5632, "dtype": torch.bfloat16}  # the prefill path
    sparse, denser = cost.time_ratio(density=0.005, **shape), cost.time_ratio(density=0.1, **shape)
    assert 0 < sparse < denser
    assert len(json.loads((tmp_path / "costs.json").read_text())) == 2
    plain = cost.time_ratio(density=0.005, **{**shape, "kind": "plain"})
    assert plain > 0
    one_token = cost.timings(**{**shape, "m": 1}, density=0.005)  # the decode kernels, captured in a graph
    assert one_token["timing"] == "graph" and 0 < one_token["twell_s"] < one_token["dense_s"]

    model = Stack(GatedFFN(256, 1024, identity_gate=True)).cuda().to(torch.bfloat16)
    batch = {"x": sparse_input(2048, 256, 0.01).view(4, 512, 256).cuda().to(torch.bfloat16)}
    config = {"progress": False, "cache_dir": tmp_path}
    decision = calibrate(model, [candidate_of(model, 0)], [batch], config=config)["blocks.0"]
    assert decision.cost_model.startswith("benchmark on ") and decision.predicted_speedup["prefill"] > 0
    assert 0 < decision.time_share["prefill"] < 1


def test_benchmark_cost_model_needs_a_gpu_or_a_name():
    with pytest.raises(ValueError, match="CUDA"):
        BenchmarkCostModel(device="cpu")


def test_predicted_model_speedup_is_amdahl():
    decisions = {
        "a": Decision("a", True, "", predicted_speedup={"prefill": 2.0}, time_share={"prefill": 0.3}),
        "b": Decision("b", False, "", predicted_speedup={"prefill": 3.0}, time_share={"prefill": 0.2}),
        "c": Decision("c", False, "not rewritable"),
    }
    summary = predicted_model_speedup(decisions)
    assert summary["ffn_time_share"] == pytest.approx(0.5)
    assert summary["rewritten_time_share"] == pytest.approx(0.3)
    assert summary["speedup"] == pytest.approx(1 / (1 - 0.15)) and summary["timed_ffns"] == 2
    assert predicted_model_speedup(decisions, "decode") == {
        "timed_ffns": 0,
        "ffn_time_share": 0.0,
        "rewritten_time_share": 0.0,
        "speedup": 1.0,
    }


# --- plans ------------------------------------------------------------------------------------------


@pytest.fixture
def calibrated():
    model = Stack(GatedFFN(32, 64, identity_gate=True), GatedFFN(32, 64))
    candidates = [candidate_of(model, 0), candidate_of(model, 1, rewritable=False, reason="shared hidden")]
    decisions = calibrate(model, candidates, [{"x": sparse_input(40, 32, 0.012)}], config=FAST)
    return model, candidates, decisions


def test_plan_round_trip(tmp_path, calibrated):
    _, candidates, decisions = calibrated
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    plan = json.loads(path.read_text())
    assert plan["format"] == "twell-plan" and plan["version"] == 1
    loaded = load_plan(path, candidates)
    assert loaded == decisions
    assert all(isinstance(d, Decision) for d in loaded.values())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop(), "different model: plan has 2 FFNs, the model 1; not in the model: blocks.1"),
        (lambda c: c.append(Candidate("blocks.9", None, 64, 32)), "not in the plan: blocks.9"),
        (lambda c: setattr(c[0], "hidden_size", 128), "blocks.0 has hidden_size=128, the plan 64"),
        (lambda c: setattr(c[0], "kind", "plain"), "kind='plain'"),
        (lambda c: setattr(c[0], "activation", "gelu"), "activation='gelu'"),
        (lambda c: setattr(c[0], "rewritable", False), "not rewritable in this model"),
    ],
    ids=["fewer", "more", "shape", "kind", "activation", "now-unsafe"],
)
def test_plan_for_another_model_is_refused(tmp_path, calibrated, change, message):
    _, candidates, decisions = calibrated
    assert decisions["blocks.0"].rewrite
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    other = [Candidate(**vars(c)) for c in candidates]
    change(other)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_plan(path, other)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "other"}', "not a twell plan"),
        ('{"format": "twell-plan", "version": 99}', "format version 99"),
    ],
)
def test_bad_plan_files(tmp_path, calibrated, content, message):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_plan(path, calibrated[1])
    with pytest.raises(ValueError, match="cannot read plan"):
        load_plan(tmp_path / "missing.json", calibrated[1])


def test_plan_with_unknown_dense_phases_is_refused(tmp_path, calibrated):
    _, candidates, decisions = calibrated
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    plan = json.loads(path.read_text())
    plan["decisions"]["blocks.0"]["dense_phases"] = ["training"]
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="dense_phases must be a list of"):
        load_plan(path, candidates)
    plan["decisions"]["blocks.0"]["dense_phases"] = []
    plan["decisions"]["blocks.0"]["decode_cap"] = 0
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="decode_cap must be a positive int or null, got 0"):
        load_plan(path, candidates)


def test_plan_with_an_invalid_layout_is_refused(tmp_path, calibrated):
    _, candidates, decisions = calibrated
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    plan = json.loads(path.read_text())
    plan["decisions"]["blocks.0"]["slots"] = 300
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="blocks.0: invalid TwELL layout: slots must be <= tile_n"):
        load_plan(path, candidates)


def test_plan_written_with_the_old_compression_key_is_read(tmp_path, calibrated):
    """Plans saved before the layout was named by its slots hold "compression" (tile_n / slots)."""
    _, candidates, decisions = calibrated
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    plan = json.loads(path.read_text())
    for decision in plan["decisions"].values():
        slots = decision.pop("slots")
        decision["compression"] = None if slots is None else decision["tile_n"] // slots
        for stats in decision["stats"].values():
            overflow = stats["overflow_rows"]
            stats["overflow_rows"] = {
                t: {str(int(t) // int(s)): f for s, f in by.items()} for t, by in overflow.items()
            }
    assert any(d["compression"] not in (None, 1) for d in plan["decisions"].values())
    path.write_text(json.dumps(plan))
    assert load_plan(path, candidates) == decisions
    plan["decisions"]["blocks.0"]["compression"] = 3
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="blocks.0: invalid TwELL layout: tile_n must be a multiple of compression"):
        load_plan(path, candidates)


def test_plan_with_a_layout_the_kernels_cannot_run_is_refused(tmp_path, calibrated):
    """A rewritten layer runs with its decision's layout: one the kernels cannot take (a plan from
    before tile widths were limited to theirs) fails on loading, not on the first call."""
    _, candidates, decisions = calibrated
    path = tmp_path / "plan.json"
    save_plan(decisions, candidates, path)
    plan = json.loads(path.read_text())
    plan["decisions"]["blocks.0"].update(rewrite=True, tile_n=512, slots=64)
    path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match=r"rewrites blocks.0 with a layout the kernels cannot run .*tile_n <= 256"):
        load_plan(path, candidates)


def test_save_plan_refuses_decisions_for_unknown_ffns(tmp_path, calibrated):
    _, candidates, decisions = calibrated
    with pytest.raises(ValueError, match="blocks.1"):
        save_plan(decisions, candidates[:1], tmp_path / "plan.json")


# --- Hugging Face models: cached greedy decode steps ------------------------------------------------


@pytest.mark.parametrize("with_mask", [False, True], ids=["ids", "ids+mask"])
def test_decode_steps_on_a_hugging_face_model(with_mask):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="relu",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    candidates = [
        Candidate(f"model.layers.{i}.mlp", layer.mlp.gate_proj, 64, 32) for i, layer in enumerate(model.model.layers)
    ]
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if with_mask else ids
    decisions = calibrate(model, candidates, [batch], config={"progress": False, "decode_steps": 3})
    for decision in decisions.values():
        assert decision.stats["prefill"]["rows"] == 16 and decision.stats["prefill"]["calls"] == 1
        assert decision.stats["decode"]["rows"] == 6 and decision.stats["decode"]["calls"] == 3
        assert 0 < decision.time_share["prefill"] < 1 and 0 < decision.time_share["decode"] < 1
    no_decode = calibrate(model, candidates, [batch], config={**FAST, "decode_steps": 0})
    assert all("decode" not in d.stats for d in no_decode.values())


@pytest.mark.parametrize(
    "config, match",
    [
        ({"min_speedup": "1.1"}, "min_speedup must be a number"),
        ({"min_speedup": float("nan")}, "finite number >= 0"),
        ({"layouts": 256}, "layouts must be a sequence"),
        ({"cost_model": "analytical"}, "cost_model must be"),
    ],
    ids=["speedup-string", "speedup-nan", "layouts-int", "cost-model-typo"],
)
def test_bad_config_fails_before_the_model_runs(config, match):
    calls = []
    model = Stack(GatedFFN(32, 64, identity_gate=True))
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=match):
        calibrate(model, [candidate_of(model, 0)], [{"x": sparse_input(4, 32, 0.02)}], config={**FAST, **config})
    assert not calls


def test_calibrated_train_hot_takes_the_size_that_saves_most():
    """policy.calibrated_train_hot on the measured shapes' shares: the skewed 0.5% layer (top 256 held 44%
    of its 32.3 kept pairs a row) takes 256, a uniform one (top 256 ~5-12%) none; sizes past a quarter of N,
    unmeasured sizes and no measurement give none; a lower rate takes more neurons."""
    skewed = {"128": 0.31, "256": 0.44, "512": 0.58}
    assert policy.calibrated_train_hot(skewed, 32.3, 5632) == 256
    assert policy.calibrated_train_hot(skewed, 32.3, 5632, rate=0.01) == 512
    assert policy.calibrated_train_hot(skewed, 32.3, 5632, rate=0.04) == 128
    assert policy.calibrated_train_hot({"128": 0.03, "256": 0.05, "512": 0.12}, 36.5, 5632) == 0
    assert policy.calibrated_train_hot(skewed, 32.3, 1000) == 128  # 256 > 1000 / 4
    assert policy.calibrated_train_hot({"512": 0.35}, 32.3, 5632) == 0  # 11.3 pairs moved for 12.8
    assert policy.calibrated_train_hot({}, 32.3, 5632) == policy.calibrated_train_hot(skewed, None, 5632) == 0


def hot_input(rows: int, n: int = 1024) -> torch.Tensor:
    """[rows, n] pre-activations: neurons 0-127 fire on every 32nd row each, 4 a row (128 * 64 of the
    pairs at 2048 rows), and one of 64 other neurons on every even row (16 rows each): 0.44% dense."""
    x = torch.full((rows, n), -1.0)
    i = torch.arange(rows)[:, None]
    hot = torch.arange(128)[None, :]
    x[:, :128] = torch.where((i + hot) % 32 == 0, 1.0, -1.0)
    even = torch.arange(0, rows, 2)
    x[even, 128 + (7 * even) % 896] = 1.0
    return x


def test_calibration_chooses_train_hot_per_layer():
    """Calibration measures the share of a layer's kept pairs held by its most frequent neurons and takes
    the train_hot that saves most where the layer trains sparse (calibrated_train_min_m): here 128 (8/9 of
    the pairs; 256 and 512 cost more than they move). Fewer than HOT_MIN_ROWS rows measure none; a layer
    training dense gets none unless sparsify's changes turn sparse training on; changes' train_hot wins."""
    model = Stack(GatedFFN(1024, 1024, identity_gate=True))
    config = {**FAST, "min_speedup": 0.0}
    decision = calibrate(model, [candidate_of(model, 0)], [{"x": hot_input(2048)}], config=config)["blocks.0"]
    assert decision.density == pytest.approx(9216 / (2048 * 1024))
    assert decision.hot_pair_shares == pytest.approx({"128": 8192 / 9216, "256": 1.0, "512": 1.0})
    assert decision.train_hot == 128 and decision.rewrite
    assert decision.layer_config().train_min_m == policy.calibrated_train_min_m(decision.density, 1024)
    assert decision.layer_config().train_hot == 128
    assert decision.layer_config({"train_hot": 256}).train_hot == 256
    assert Decision.from_dict(json.loads(json.dumps(decision.to_dict()))).layer_config().train_hot == 128

    few = calibrate(model, [candidate_of(model, 0)], [{"x": hot_input(1000)}], config=config)["blocks.0"]
    assert 1000 < HOT_MIN_ROWS and few.hot_pair_shares == {} and few.train_hot == 0

    dense = Decision(path="mlp", rewrite=True, reason="", density=0.02, hidden_size=1024, train_hot=128)
    assert dense.layer_config().train_min_m is None and dense.layer_config().train_hot == 0
    assert dense.layer_config({"train_min_m": 1}).train_hot == 128


def test_calibration_keeps_uniform_rates_off_the_hot_hybrid():
    """A layer whose neurons fire at one rate (4 of 1024 a row, each on 8 of 2048 rows): its top 128
    hold an eighth of the pairs, which saves nothing: train_hot 0 though it trains sparse."""
    x = torch.full((2048, 1024), -1.0)
    i = torch.arange(2048)
    for j in range(4):
        x[i, (4 * i + j) % 1024] = 1.0
    model = Stack(GatedFFN(1024, 1024, identity_gate=True))
    decision = calibrate(model, [candidate_of(model, 0)], [{"x": x}], config={**FAST, "min_speedup": 0.0})["blocks.0"]
    assert decision.hot_pair_shares["128"] == pytest.approx(0.125) and decision.train_hot == 0
    config = decision.layer_config()
    assert config.train_min_m is not None and config.train_hot == 0


def test_layer_configs_and_the_report_show_train_hot(tmp_path):
    """A plan's train_hot reaches each rewritten layer that trains sparse (twell.layer_configs), and the
    report's decisions carry it with the shares it came from."""
    from models import replanned_llama

    model = replanned_llama(tmp_path, lambda d: d.update(density=0.005, train_hot=16, hot_pair_shares={"128": 0.5}))
    configs = twell.layer_configs(model)
    assert configs and {(c.train_min_m, c.train_hot) for c in configs.values()} == {
        (policy.calibrated_train_min_m(0.005, model.config.hidden_size), 16)
    }
    records = twell.report(model).to_dict()["records"]
    assert {(r["decision"]["train_hot"], r["decision"]["hot_pair_shares"]["128"]) for r in records} == {(16, 0.5)}
