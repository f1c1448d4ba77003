"""Calibrate on text, rewrite only the FFNs where twell pays, save a plan, and re-apply it after reloading.

Uses twell's built-in demo model (a tiny byte-level Llama trained on Python source with the L1
penalty, shipped inside the package): nothing is downloaded. The same steps apply to any local
checkpoint.

    python examples/calibrate_and_save_plan.py
"""

import json
import tempfile
from pathlib import Path

import torch
import transformers

import twell
from twell.loading import calibration_batches, load_model


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="twell-example-") as workdir:
        run(Path(workdir))


def run(workdir: Path) -> None:
    # Calibration data: plain text, or JSON Lines of strings or of {"text": ...} objects.
    data = workdir / "calibration.jsonl"
    texts = ["def add(a, b):\n    return a + b\n\n" * 8, "for item in items:\n    print(item)\n" * 8]
    data.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")

    loaded = load_model("twell-demo")  # or a checkpoint directory, or a hub id already in the local cache
    model = loaded.model
    batches, note = calibration_batches(loaded, data=data, samples=8, seq_len=64, batch_size=4)
    print(f"calibration data: {note}")
    ids = batches[0]
    with torch.no_grad():
        expected = model(ids).logits

    # Measure each FFN's sparsity and rewrite those whose predicted speedup reaches min_speedup.
    twell.sparsify(model, calibration_data=batches, config={"timing_repeats": 0})
    print(twell.report(model))
    plan = workdir / "plan.json"
    twell.save_plan(model, plan)

    # save_pretrained writes the original weights: the checkpoint loads anywhere, with or without twell.
    model.save_pretrained(workdir / "checkpoint")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(workdir / "checkpoint").eval()
    # Re-apply the same decisions without calibrating again.
    twell.sparsify(reloaded, plan=plan)
    rewritten = [r.path for r in twell.report(reloaded) if r.rewritten]
    assert rewritten == [r.path for r in twell.report(model) if r.rewritten]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
    print(f"plan {plan} re-applied after reloading: {len(rewritten)} FFNs rewritten, logits match")


if __name__ == "__main__":
    main()
