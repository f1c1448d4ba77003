"""Bad input says what was expected, in one line: calibration data, checkpoints, models with nothing to
rewrite or warm up, plans that rewrite nothing, and `twell` without a command."""

import json

import pytest
import torch
from torch import nn

import twell

pytest.importorskip("transformers")

from models import VOCAB, build, token_ids  # noqa: E402
from test_cli import QUICK, run, save_tiny  # noqa: E402


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (
            torch.tensor([[3, VOCAB + 5, 7]]),
            rf"calibration batch 0 holds token ids from 3 to {VOCAB + 5}: expected ids in \[0, {VOCAB}\)",
        ),
        (
            torch.tensor([[3, -1, 7]]),
            rf"calibration batch 0 holds token ids from -1 to 7: expected ids in \[0, {VOCAB}\)",
        ),
        (
            torch.zeros(2, 0, dtype=torch.int64),
            r"calibration batch 0 is empty \(shape \[2, 0\]\): expected at least one token",
        ),
        (
            {"ids": token_ids()},
            r"calibration batch 0 is a dict with keys \['ids'\]: expected the model's input under 'input_ids' or "
            "'inputs_embeds'",
        ),
        (
            {"input_ids": torch.tensor([[VOCAB]])},
            rf"calibration batch 0\['input_ids'\] holds token ids from {VOCAB} to {VOCAB}",
        ),
        (
            torch.randn(2, 5),
            r"calibration batch 0 must hold token ids \[batch, seq\] or \[seq\] \(int64\), got torch.float32",
        ),
    ],
    ids=["past-vocabulary", "negative", "empty", "wrong-key", "dict-past-vocabulary", "floats"],
)
def test_bad_calibration_batches_are_named(batch, message):
    model = build("llama")
    with pytest.raises(ValueError, match=message):
        twell.sparsify(model, [batch])
    assert twell.report(model).summary()["rewritten"] == 0  # refused before anything ran or changed


def test_calibration_data_must_be_batches():
    with pytest.raises(TypeError, match="an iterable of batches .* got Tensor"):
        twell.sparsify(build("llama"), token_ids())
    with pytest.raises(ValueError, match="calibration data is empty"):
        twell.sparsify(build("llama"), [])


def test_checkpoint_that_does_not_fit_its_config_names_the_tensor(tmp_path, capsys):
    path = save_tiny(tmp_path / "tiny")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] += 16
    (path / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    rc, out, err = run(["report", path, *QUICK], capsys)
    assert rc == 1
    n = config["intermediate_size"]
    assert err.count("\n") == 1 and err.startswith("twell: error: "), err
    assert f"model.layers.0.mlp.gate_proj.weight is [{n - 16}, " in err and f"in the checkpoint, [{n}, " in err, err


def test_sparsify_on_a_module_without_ffn_says_so():
    with pytest.raises(ValueError, match="no FFN found in Sequential: sparsify rewrites feed-forward blocks"):
        twell.sparsify(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_warmup_on_a_model_with_nothing_rewritten_says_so():
    with pytest.raises(ValueError, match="nothing to warm up in LlamaForCausalLM: it is not sparsified"):
        twell.warmup(build("llama"))
    silu = twell.sparsify(build("llama", activation=None))
    with pytest.raises(ValueError, match="sparsify rewrote none of its FFNs"):
        twell.warmup(silu)


def test_convert_warns_when_the_plan_rewrites_nothing(tmp_path, capsys):
    path = save_tiny(tmp_path / "tiny", hidden_act="silu")
    rc, out, err = run(["convert", path, "--out", tmp_path / "plan.json", *QUICK], capsys)
    assert rc == 0, err
    assert f"twell: warning: the plan {tmp_path / 'plan.json'} rewrites nothing (all 2 FFNs stay dense)" in err


def test_twell_without_a_command_fails(capsys):
    rc, out, err = run([], capsys)
    assert rc == 2 and "usage: twell" in err
