"""Running the model: calibrate() drives the batches (a prefill call, then greedy cached decode
steps), times each FFN's share of model time, and turns the hooks' counts into decisions."""

from __future__ import annotations

import inspect
import math
import re
import time
from collections.abc import Callable, Mapping

import torch

from twell.calibrate.config import PHASES, CalibrationConfig
from twell.calibrate.costs import AnalyticCostModel, resolve_cost_model
from twell.calibrate.decisions import Decision, decide, layer_changes
from twell.calibrate.hooks import LayerRecorder
from twell.distributed import agree, sharded
from twell.inputs import check_batches


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _as_kwargs(batch, device: torch.device) -> dict:
    if isinstance(batch, torch.Tensor):
        if batch.dtype not in (torch.int64, torch.int32) or batch.dim() not in (1, 2):
            raise ValueError(
                f"a tensor batch must hold token ids [batch, seq] or [seq], got {batch.dtype} {list(batch.shape)}"
            )
        batch = {"input_ids": batch if batch.dim() == 2 else batch.unsqueeze(0)}
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"calibration batches must be token-id tensors or dicts of forward kwargs, got {type(batch).__name__}"
        )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _cache_argument(model: torch.nn.Module) -> str | None:
    """Name of the KV-cache argument of a Hugging Face causal LM (transformers renamed it in 5.x), or
    None for models without one (or without a config that enables caching): those get no decode steps."""
    if getattr(getattr(model, "config", None), "use_cache", None) is None:
        return None
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return None


def _run_batch(model, kwargs: dict, decode_steps: int, on_phase: Callable[[str], None] = lambda phase: None) -> None:
    """One prefill call, then `decode_steps` greedy one-token calls on the KV cache where supported."""
    on_phase("prefill")
    cache_argument = _cache_argument(model) if decode_steps and "input_ids" in kwargs else None
    if cache_argument is None:
        model(**kwargs)
        return
    out = model(**{**kwargs, "use_cache": True})
    mask = kwargs.get("attention_mask")
    on_phase("decode")
    for _ in range(decode_steps):
        cache = out.get(cache_argument) if isinstance(out, Mapping) else None
        if cache is None or out.get("logits") is None:
            return
        token = out["logits"][:, -1:].argmax(dim=-1)
        step = {"input_ids": token, cache_argument: cache, "use_cache": True}
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            step["attention_mask"] = mask
        out = model(**step)


def _progress(items: list, enabled: bool, description: str):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    # On stderr, so stdout stays clean for reports and JSON; and only on a terminal: elsewhere (a log
    # file, a pipe) a transient bar leaves nothing to read but a blank line.
    console = Console(stderr=True)
    disable = not (enabled and console.is_terminal)
    with Progress(*columns, console=console, transient=True, disable=disable) as progress:
        yield from progress.track(items, description=description)


_INLINE_PATH = re.compile(r"^(?P<owner>.*)\[(?P<linears>[^\[\]]+)\]$")


def _ffn_modules(model: torch.nn.Module, path: str) -> list[torch.nn.Module] | None:
    """The modules whose time is the FFN's: its own module, or for an FFN written inline in a bigger
    module ("owner[fc1,fc2]") its linears (the elementwise activation between them is left out)."""
    try:
        return [model.get_submodule(path)]
    except AttributeError:
        pass
    inline = _INLINE_PATH.match(path)
    if inline is None:
        return None
    try:
        owner = model.get_submodule(inline["owner"])
        return [owner.get_submodule(name.strip()) for name in inline["linears"].split(",")]
    except AttributeError:
        return None


def _time_shares(model, batch: dict, ffns: Mapping[str, list[torch.nn.Module]], repeats: int, decode_steps: int):
    """Per path and phase: the fraction of the model's time spent in that FFN (no statistics hooks).

    One run of `batch` records the inputs of every call of the FFNs' modules; then, `repeats` times,
    the model runs the batch (timed per phase) and each FFN's modules rerun their recorded inputs
    (timed), keeping the best times. Timing FFN calls inside a model run would be noise-bound: one FFN
    call of a small model lasts about as long as a scheduler hiccup on a busy machine.
    """
    cuda = _model_device(model).type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    phase = {"now": None}
    modules = {id(m): m for ms in ffns.values() for m in ms}
    calls = {key: {p: [] for p in PHASES} for key in modules}

    def recorder(key):
        def hook(module, args, kwargs):
            calls[key][phase["now"]].append((args, kwargs))

        return hook

    handles = [m.register_forward_pre_hook(recorder(key), with_kwargs=True) for key, m in modules.items()]
    try:
        _run_batch(model, batch, decode_steps, lambda p: phase.update(now=p))  # also the warm-up
    finally:
        for h in handles:
            h.remove()

    # Interleaved repeats, best of each: noise on a shared machine only ever adds time.
    best_model = dict.fromkeys(PHASES, math.inf)
    best_module = {key: dict.fromkeys(PHASES, math.inf) for key in modules}
    for _ in range(repeats):
        run = {"phase": None, "since": 0.0, "times": dict.fromkeys(PHASES, 0.0)}

        def on_phase(p, run=run):
            t = now()
            if run["phase"] is not None:
                run["times"][run["phase"]] += t - run["since"]
            run["phase"], run["since"] = p, t

        _run_batch(model, batch, decode_steps, on_phase)
        on_phase(None)
        for p in PHASES:
            best_model[p] = min(best_model[p], run["times"][p])
        for key, module in modules.items():
            for p in PHASES:
                if calls[key][p]:
                    start = now()
                    for args, kwargs in calls[key][p]:
                        module(*args, **kwargs)
                    best_module[key][p] = min(best_module[key][p], now() - start)
    shares: dict[str, dict[str, float]] = {path: {} for path in ffns}
    for p in PHASES:
        phase_shares = {}
        for path, ms in ffns.items():
            times = [best_module[id(m)][p] for m in ms]
            if best_model[p] > 0 and all(t < math.inf for t in times):
                phase_shares[path] = sum(times) / best_model[p]
        # FFNs taking more than the whole model: the machine's load spoiled the timing; report none.
        if sum(phase_shares.values()) <= 1.0:
            for path, share in phase_shares.items():
                shares[path][p] = share
    return shares


@torch.no_grad()
def calibrate(model: torch.nn.Module, candidates, data, *, config=None, layer_config=None) -> dict[str, Decision]:
    """Measure each candidate FFN over `data` and decide whether rewriting it to twell pays.

    model: the model to run (left unchanged; eval mode during calibration, its mode restored after).
    candidates: twell.passes.find_ffns(model) records (path, kind, rewritable, reason, gate_module,
        gate_slice, measure, threshold, hidden_size, model_size).
    data: an iterable of batches: token-id tensors [batch, seq] or dicts of forward kwargs.
    config: CalibrationConfig, a dict of its fields, or None.
    layer_config: LayerConfig field changes the rewritten layers will run with (sparsify's), so that
        the cost model predicts for them; not tile_n or slots (calibration chooses the layout).
    Returns {candidate.path: Decision}, one per candidate; candidates that are not rewritable get
    rewrite=False with their own reason and no measurements.
    """
    cfg = CalibrationConfig.coerce(config)
    changes = layer_changes(layer_config, calibrated=True)
    candidates = list(candidates)
    device, dtype = _model_device(model), _model_dtype(model)
    batches = [_as_kwargs(b, device) for b in check_batches(model, data)]
    if not batches:
        raise ValueError("calibration data is empty: give at least one batch")

    measured = [c for c in candidates if c.rewritable]
    # resolved before the model runs, so a bad cost_model fails fast
    cost = resolve_cost_model(cfg.cost_model, device, cfg.cache_dir) if measured else AnalyticCostModel()
    driver = {"phase": "prefill"}
    recorders = {c.path: LayerRecorder(c, cfg, driver) for c in measured}
    was_training = model.training
    model.eval()
    try:
        ffns = {c.path: ms for c in measured if (ms := _ffn_modules(model, c.path))}
        shares = {}
        # A sharded model's FFNs cannot be rerun on their own (FSDP gathers their weights only inside
        # the model's run), and ranks would time them differently: no time shares.
        if cfg.timing_repeats and ffns and not sharded(model):
            shares = _time_shares(model, batches[0], ffns, cfg.timing_repeats, cfg.decode_steps)

        handles = [c.gate_module.register_forward_hook(recorders[c.path], with_kwargs=True) for c in measured]
        try:
            # Nothing to measure (no rewritable FFN): no need to run the model at all.
            for kwargs in _progress(batches if measured else [], cfg.progress, "calibrating"):
                _run_batch(model, kwargs, cfg.decode_steps, lambda phase: driver.update(phase=phase))
        finally:
            for h in handles:
                h.remove()
    finally:
        model.train(was_training)

    decisions = {}
    for c in candidates:
        if c.rewritable:
            decisions[c.path] = decide(c, recorders[c.path], cfg, cost, shares.get(c.path, {}), dtype, changes)
        else:
            decisions[c.path] = Decision(
                path=c.path,
                rewrite=False,
                reason=c.reason,
                kind=c.kind,
                hidden_size=int(c.hidden_size),
                model_size=int(c.model_size),
                threshold=float(c.threshold),
            )
    return agree(model, decisions)
