"""Decisions: per FFN, the TwELL layout, the predicted speedup per phase, and whether to rewrite
(Decision, decide); and the model-level prediction over them (predicted_model_speedup)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from twell.calibrate.config import PHASES, CalibrationConfig
from twell.calibrate.costs import CostModel
from twell.calibrate.hooks import LayerRecorder, PhaseCounter
from twell.format import check_layout
from twell.kernels import policy
from twell.kernels.policy import LayerConfig


@dataclass
class Decision:
    """What calibration decided for one FFN, and the measurements behind it.

    rewrite / reason: the decision and why. tile_n / slots: the TwELL layout (None when not
    rewritten for lack of a layout). density: mean kept fraction over all calls. stats: per phase
    ("prefill", "decode") the counts of PhaseCounter.summary. predicted_speedup: FFN time dense / twell,
    per phase. time_share: fraction of model time spent in this FFN, per phase (dense; for an FFN
    written inline in a bigger module, the time of its linears). min_speedup: the threshold the
    predicted speedups were held against (None when nothing was predicted). dense_phases: the phases of
    a rewritten FFN whose calls run dense because twell was predicted slower there (their
    predicted_speedup is then 1). hot_pair_shares: {str(H): share of the layer's kept pairs held by its
    H most frequent neurons} over all calibration rows, for H of policy.TRAIN_HOT_SIZES up to N (empty
    below HOT_MIN_ROWS rows); train_hot: the hot neurons of its sparse training calls chosen from them
    (policy.calibrated_train_hot), which layer_config takes where the layer trains sparse. decode_cap:
    the largest decode call size the decode kernels keep, where calibration's decode calls came in
    several sizes and a larger one was predicted slower than dense (None: no cap); the decode phase is
    predicted per call size (_decode_speedup), so a batch size that loses does not turn off the
    one-token calls that win.
    """

    path: str
    rewrite: bool
    reason: str
    kind: str = "gated"
    hidden_size: int = 0
    model_size: int = 0
    threshold: float = 0.0
    tile_n: int | None = None
    slots: int | None = None
    density: float | None = None
    dead_neurons: int | None = None
    overflow_rows: float | None = None
    predicted_speedup: dict[str, float] = field(default_factory=dict)
    time_share: dict[str, float] = field(default_factory=dict)
    stats: dict[str, dict] = field(default_factory=dict)
    cost_model: str | None = None
    min_speedup: float | None = None
    dense_phases: list[str] = field(default_factory=list)
    hot_pair_shares: dict[str, float] = field(default_factory=dict)
    train_hot: int = 0
    decode_cap: int | None = None

    def to_dict(self) -> dict:
        """JSON-serialisable dict (round-trips through from_dict)."""
        return dataclasses.asdict(self)

    def layer_config(self, changes: Mapping | None = None) -> LayerConfig:
        """The LayerConfig the FFN runs with once rewritten: this decision's layout (the defaults without
        one) and its dense phases' routes turned off, then `changes` (checked by layer_changes); where
        the result trains sparse (train_min_m set) and `changes` do not set train_hot, its train_hot."""
        density = self.stats.get("decode", {}).get("density", self.density)
        changes = dict(changes or {})
        config = policy.default_config(self.model_size).replace(
            decode_max_m=policy.calibrated_decode_max_m(density, self.model_size),
            train_min_m=policy.calibrated_train_min_m(self.density, self.hidden_size),
        )
        if self.tile_n is not None:
            config = config.replace(tile_n=self.tile_n, slots=self.slots)
        if self.decode_cap is not None:
            cap = self.decode_cap
            config = config.replace(
                decode_max_m=min(config.decode_max_m, cap), decode_sparse_max_m=min(config.decode_sparse_max_m, cap)
            )
        config = config.replace(**{**self.route_changes(), **changes})
        if config.train_min_m is not None and "train_hot" not in changes:
            config = config.replace(train_hot=self.train_hot)
        return config

    def route_changes(self) -> dict:
        """LayerConfig changes that send the dense phases' calls to the dense route."""
        changes = {}
        if "decode" in self.dense_phases:
            changes.update(decode_max_m=0, decode_sparse_max_m=0)
        if "prefill" in self.dense_phases:
            changes["prefill_min_m"] = None
        return changes

    @classmethod
    def from_dict(cls, data: Mapping) -> Decision:
        """The decision of a dict from to_dict; also of a plan written before the layout was named by its
        slots, with "compression" (tile_n / slots) instead of "slots"."""
        known = {f.name for f in dataclasses.fields(cls)}
        missing = {"path", "rewrite", "reason"} - set(data)
        if missing:
            raise ValueError(f"decision is missing {sorted(missing)}")
        decision = cls(**{k: v for k, v in data.items() if k in known})
        if "compression" in data and "slots" not in data:
            decision.slots = _slots_of_compression(decision.path, decision.tile_n, data["compression"])
            for stats in decision.stats.values():  # overflow fractions by tile width, then compression
                overflow = stats.get("overflow_rows", {})
                stats["overflow_rows"] = {
                    t: {str(int(t) // int(c)): f for c, f in by_c.items()} for t, by_c in overflow.items()
                }
        cap = decision.decode_cap
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"decision for {decision.path}: decode_cap must be a positive int or null, got {cap!r}")
        if not isinstance(decision.dense_phases, list) or not set(decision.dense_phases) <= set(PHASES):
            raise ValueError(f"decision for {decision.path}: dense_phases must be a list of {PHASES}")
        if decision.tile_n is not None or decision.slots is not None:
            try:
                check_layout(decision.tile_n, decision.slots)
            except ValueError as e:
                raise ValueError(f"decision for {decision.path}: invalid TwELL layout: {e}") from None
        return decision


def _slots_of_compression(path: str, tile_n, compression) -> int | None:
    """The slots of an old plan's (tile_n, compression) layout; ValueError where tile_n is not a multiple."""
    if compression is None:
        return None
    if not isinstance(tile_n, int) or not isinstance(compression, int) or compression < 1 or tile_n % compression:
        raise ValueError(
            f"decision for {path}: invalid TwELL layout: tile_n must be a multiple of compression, got "
            f"tile_n={tile_n}, compression={compression!r}"
        )
    return tile_n // compression


def layer_changes(changes: Mapping | None, calibrated: bool) -> dict:
    """sparsify's layer_config: LayerConfig field changes (and "route", see LayerConfig.replace) for
    every rewritten FFN, checked. calibrated: the layers' layouts come from decisions, so the changes
    may not set tile_n or slots."""
    if changes is None:
        return {}
    if not isinstance(changes, Mapping):
        raise TypeError(f"layer_config must be a dict of LayerConfig fields, got {type(changes).__name__}")
    changes = dict(changes)
    policy.DEFAULT.replace(**changes)  # unknown fields and bad values fail here, before any model runs
    layout = sorted({"tile_n", "slots"} & set(changes))
    if calibrated and layout:
        raise ValueError(
            f"layer_config sets {layout}: with calibration data or a plan, each layer's layout is its decision's"
        )
    return changes


def decide(
    candidate, recorder: LayerRecorder, cfg: CalibrationConfig, cost: CostModel, shares, dtype, changes: dict
) -> Decision:
    decision = Decision(
        path=candidate.path,
        rewrite=False,
        reason="",
        kind=candidate.kind,
        hidden_size=int(candidate.hidden_size),
        model_size=int(candidate.model_size),
        threshold=float(candidate.threshold),
        time_share={p: s for p, s in shares.items() if s is not None},
        cost_model=cost.name,
    )
    # A tile wider than the layer only adds empty slots: keep tile widths up to N (the smallest if none).
    all_layouts = cfg.preferred_layouts()
    narrowest = min(t for t, _ in all_layouts)
    layouts = [(t, s) for t, s in all_layouts if t <= max(decision.hidden_size, narrowest)]
    if not recorder.phases:
        decision.reason = "never called during calibration"
        return decision
    decision.stats = {p: c.summary(layouts) for p, c in recorder.phases.items()}
    rows = sum(c.rows for c in recorder.phases.values())
    kept = sum(s["density"] * s["rows"] for s in decision.stats.values())
    decision.density = kept / max(rows, 1)
    decision.dead_neurons = recorder.dead_neurons()
    decision.hot_pair_shares = _hot_pair_shares(recorder, rows)
    decision.train_hot = policy.calibrated_train_hot(
        decision.hot_pair_shares, decision.density * decision.hidden_size, decision.hidden_size
    )

    fitting = [(t, s) for t, s in layouts if recorder.overflow_fraction(t, s) <= cfg.max_overflow]
    if not fitting:
        t, s = min(layouts, key=lambda p: recorder.overflow_fraction(*p))
        decision.overflow_rows = recorder.overflow_fraction(t, s)
        decision.reason = (
            f"too dense for TwELL: {decision.overflow_rows:.1%} of rows overflow even at tile {t} with {s} "
            f"slots (limit {cfg.max_overflow:.1%})"
        )
        return decision
    decision.tile_n, decision.slots = fitting[0]
    decision.overflow_rows = recorder.overflow_fraction(*fitting[0])
    config = decision.layer_config(changes)  # what the layer will run with
    for phase, counter in recorder.phases.items():
        stats = decision.stats[phase]

        def speedup(m, counter=counter, stats=stats):
            density, hot_share = _sparse_share(counter, config, stats, m, decision.model_size)
            ratio = cost.time_ratio(
                kind=candidate.kind,
                m=m,
                k=decision.model_size,
                n=-(-decision.hidden_size // recorder.shards),  # the width each rank runs
                density=density,
                dtype=dtype,
                config=config,
            )
            if ratio < 1.0:  # the hot neurons' dense products cost about their share of the dense FFN
                ratio = min(1.0, ratio + hot_share)
            # Overflow rows run dense (the format's dense backup).
            overflow = counter.overflow_fraction(decision.tile_n, decision.slots)
            return 1.0 / ((1.0 - overflow) * ratio + overflow)

        if phase == "decode":
            decision.predicted_speedup[phase], decision.decode_cap = _decode_speedup(
                counter, stats, config, decision.model_size, speedup
            )
        else:
            decision.predicted_speedup[phase] = speedup(_prefill_tokens(cfg, stats["rows_per_call_median"], config))
    # Rewrite where any phase pays; a phase twell would slow down then runs dense (its route turned
    # off), so no phase of a rewritten FFN is predicted slower than dense.
    speedups = decision.predicted_speedup
    best = max(speedups, key=speedups.get)
    decision.min_speedup = float(cfg.min_speedup)
    decision.rewrite = speedups[best] >= cfg.min_speedup
    verdict = "reaching" if decision.rewrite else "below"
    decision.reason = (
        f"predicted {speedups[best]:.2f}x ({best}, {decision.stats[best]['density']:.2%} dense), "
        f"{verdict} the {cfg.min_speedup:.2f}x threshold"
    )
    if decision.rewrite:
        decision.dense_phases = [p for p in PHASES if speedups.get(p, 1.0) < 1.0]
        for phase in decision.dense_phases:
            decision.reason += f"; {phase} calls run dense (predicted {speedups[phase]:.2f}x)"
            speedups[phase] = 1.0
        if decision.decode_cap is not None:
            decision.reason += f"; decode calls of more than {decision.decode_cap} tokens run dense"
    return decision


def _decode_speedup(
    counter: PhaseCounter, stats: dict, config: LayerConfig, k: int, speedup
) -> tuple[float, int | None]:
    """The decode phase's predicted speedup and Decision.decode_cap, by call size: each size calibration
    saw, weighted by its calls, predicted by speedup(m); sizes the layer's route sends dense count as
    dense (no prediction: the same kernels). Where the decode kernels are predicted to win up to some
    size and lose past it, the cap keeps them to the sizes that win (the phase predicted as it then
    runs); where they lose at the smallest size, no cap: the phase as a whole, which the caller runs
    dense if it is slower."""
    sizes = collections.Counter(counter.rows_per_call)
    gains = {m: speedup(m) for m in sizes if policy.route(m, k, config, stats["density"]) != "dense"}
    cap = None
    for m in sorted(gains):
        if gains[m] < 1.0:
            cap = max((w for w in gains if w < m), default=0)
            break
    limit = None if cap == 0 else cap

    def combined() -> float:
        time = sum(n / gains[m] if m in gains and (limit is None or m <= limit) else n for m, n in sizes.items())
        return sum(sizes.values()) / time

    return combined(), limit


# Fewer calibration rows than this give no hot-neuron estimate: from a few rows a neuron's rate cannot
# tell 2% from 0 (the dispatcher measures from up to policy.HOT_SAMPLE rows of a prefill call).
HOT_MIN_ROWS = 1024


def _hot_pair_shares(recorder: LayerRecorder, rows: int) -> dict[str, float]:
    """Decision.hot_pair_shares: over every phase's calibration rows (none below HOT_MIN_ROWS, or
    without a kept entry)."""
    counts = sum(c.neuron_counts for c in recorder.phases.values())
    total = int(counts.sum())
    if rows < HOT_MIN_ROWS or total == 0:
        return {}
    held = counts.sort(descending=True).values.cumsum(0)
    return {str(h): int(held[h - 1]) / total for h in policy.TRAIN_HOT_SIZES if h <= counts.shape[0]}


def _sparse_share(counter: PhaseCounter, config: LayerConfig, stats: dict, m: int, k: int) -> tuple[float, float]:
    """(density left to the sparse kernels, hot neurons / N) for calls of m tokens: on the prefill path
    the layer's hot neurons (policy.hot_count over the calibration rows) run as dense products;
    stats["hot_neurons"] records how many."""
    density, rows = stats["density"], counter.rows
    if config.hot_rate is None or rows < HOT_MIN_ROWS or policy.route(m, k, config) != "prefill":
        return density, 0.0
    hot = policy.hot_count(counter.neuron_counts, rows, config.hot_rate)
    stats["hot_neurons"] = hot
    if hot == 0:
        return density, 0.0
    hot_pairs = int(counter.neuron_counts.sort(descending=True).values[:hot].sum())
    return max(density - hot_pairs / (rows * counter.n), 0.0), hot / counter.n


def _prefill_tokens(cfg: CalibrationConfig, observed: int, config: LayerConfig) -> int:
    """Tokens per call the cost model predicts the prefill phase at: benchmark_tokens, else at least the
    size from which the layer's prefill kernels run (calibration batches are smaller than serving
    prefills). Decode calls are predicted at each size observed (_decode_speedup)."""
    return cfg.benchmark_tokens or max(observed, config.prefill_min_m or 0)


def predicted_model_speedup(decisions: Mapping[str, Decision], phase: str = "prefill") -> dict:
    """Amdahl over the rewritten FFNs, for `phase`: {"timed_ffns", "ffn_time_share",
    "rewritten_time_share", "speedup"}. Uses each decision's measured time share; FFNs without one
    (not timed) count as no time, so with timed_ffns == 0 the speedup is 1 for want of a measurement.
    """
    share = rewritten_share = 0.0
    saved = 0.0
    timed = 0
    for d in decisions.values():
        s = d.time_share.get(phase)
        if s is None:
            continue
        timed += 1
        share += s
        if d.rewrite and phase in d.predicted_speedup:
            rewritten_share += s
            saved += s * (1.0 - 1.0 / d.predicted_speedup[phase])
    return {
        "timed_ffns": timed,
        "ffn_time_share": share,
        "rewritten_time_share": rewritten_share,
        "speedup": 1.0 / (1.0 - saved),
    }
