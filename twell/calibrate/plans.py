"""Plan files: decisions saved as JSON with the model's FFNs, checked against a model when read."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from twell.calibrate.decisions import Decision

PLAN_FORMAT = "twell-plan"
PLAN_VERSION = 1


def _fingerprint(candidate) -> dict:
    return {
        "path": candidate.path,
        "kind": candidate.kind,
        "activation": candidate.activation,
        "hidden_size": int(candidate.hidden_size),
        "model_size": int(candidate.model_size),
    }


def save_plan(decisions: Mapping[str, Decision], candidates, path: str | os.PathLike) -> None:
    """Write decisions as a JSON plan, with the model's FFNs (from candidates) to check it against later."""
    import twell

    candidates = list(candidates)
    unknown = sorted(set(decisions) - {c.path for c in candidates})
    if unknown:
        raise ValueError(f"decisions for FFNs that are not among the candidates: {unknown}")
    plan = {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "twell_version": twell.__version__,
        "ffns": [_fingerprint(c) for c in candidates],
        "decisions": {p: d.to_dict() for p, d in decisions.items()},
    }
    Path(path).write_text(json.dumps(plan, indent=1) + "\n")


def read_plan(path: str | os.PathLike) -> tuple[dict, dict[str, Decision]]:
    """The plan's FFN fingerprints {path: {path, kind, activation, hidden_size, model_size}} and its
    decisions, unchecked against any model. Raises ValueError when the file is not a twell plan of this
    format version."""
    plan = _read_plan_file(path)
    planned = {f["path"]: f for f in plan.get("ffns", [])}
    return planned, {p: Decision.from_dict(d) for p, d in plan.get("decisions", {}).items()}


def _read_plan_file(path: str | os.PathLike) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read plan {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"plan {path} is not valid JSON: {e}") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise ValueError(f'{path} is not a twell plan (no "format": "{PLAN_FORMAT}")')
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(
            f"plan {path} has format version {plan.get('version')!r}; this twell reads version {PLAN_VERSION}: "
            "calibrate again"
        )
    return plan


def load_plan(path: str | os.PathLike, candidates) -> dict[str, Decision]:
    """Read a plan written by save_plan and check it fits the model whose FFNs are `candidates`.

    Raises ValueError with the reason when the file is not a twell plan, has another format version,
    or was made for a different model (other FFN paths, kinds, activations or shapes), or when it
    rewrites an FFN that is not rewritable in this model.
    """
    planned, decisions = read_plan(path)
    candidates = list(candidates)
    present = {c.path: _fingerprint(c) for c in candidates}
    missing, extra = sorted(set(planned) - set(present)), sorted(set(present) - set(planned))
    if missing or extra:
        parts = [f"plan has {len(planned)} FFNs, the model {len(present)}"]
        if missing:
            parts.append(f"not in the model: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"not in the plan: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        raise ValueError(f"plan {path} was made for a different model: {'; '.join(parts)}")
    for p, fingerprint in present.items():
        for key, value in fingerprint.items():
            if planned[p].get(key) != value:
                raise ValueError(
                    f"plan {path} was made for a different model: {p} has {key}={value!r}, "
                    f"the plan {planned[p].get(key)!r}"
                )
    by_path = {c.path: c for c in candidates}
    for p, d in decisions.items():
        if p not in by_path:
            raise ValueError(f"plan {path} has a decision for {p}, which is not an FFN of its own list")
        if d.rewrite and not by_path[p].rewritable:
            raise ValueError(f"plan {path} rewrites {p}, which is not rewritable in this model: {by_path[p].reason}")
        if d.rewrite:
            try:
                d.layer_config()
            except ValueError as e:
                raise ValueError(
                    f"plan {path} rewrites {p} with a layout the kernels cannot run ({e}): calibrate again"
                ) from None
    return decisions
