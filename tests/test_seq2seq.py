"""Encoder-decoder models (T5, BART, M2M100, Whisper): both stacks found, rewritten, calibrated, and
loaded as encoder-decoders through the CLI."""

import json

import pytest
import torch

import twell

transformers = pytest.importorskip("transformers")

from test_cli import QUICK, run  # noqa: E402

VOCAB = 100
_BART_LIKE = dict(
    vocab_size=VOCAB,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    activation_function="relu",
)
# family -> (config class, model class, config kwargs, the four FFN paths: encoder's then decoder's)
SEQ2SEQ = {
    "t5": (
        "T5Config",
        "T5ForConditionalGeneration",
        dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="relu"),
        [
            f"{stack}.block.{i}.layer.{j}.DenseReluDense"
            for stack, j in (("encoder", 1), ("decoder", 2))
            for i in (0, 1)
        ],
    ),
    "bart": (
        "BartConfig",
        "BartForConditionalGeneration",
        dict(_BART_LIKE, max_position_embeddings=64),
        [f"model.{stack}.layers.{i}[fc1,fc2]" for stack in ("encoder", "decoder") for i in (0, 1)],
    ),
    "m2m100": (
        "M2M100Config",
        "M2M100ForConditionalGeneration",
        dict(_BART_LIKE, max_position_embeddings=64),
        [f"model.{stack}.layers.{i}[fc1,fc2]" for stack in ("encoder", "decoder") for i in (0, 1)],
    ),
    "whisper": (
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        dict(
            _BART_LIKE,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=16,
            decoder_start_token_id=1,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        [f"model.{stack}.layers.{i}[fc1,fc2]" for stack in ("encoder", "decoder") for i in (0, 1)],
    ),
}


def build(family, seed=0):
    config_cls, model_cls, kwargs, _ = SEQ2SEQ[family]
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()


def inputs(model, seed=1):
    """Forward kwargs for both stacks: token ids (Whisper: audio features) and decoder token ids."""
    gen = torch.Generator().manual_seed(seed)
    decoder_ids = torch.randint(3, VOCAB, (2, 7), generator=gen)
    if model.main_input_name == "input_features":
        config = model.config
        features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=gen)
        return {"input_features": features, "decoder_input_ids": decoder_ids}
    return {"input_ids": torch.randint(3, VOCAB, (2, 9), generator=gen), "decoder_input_ids": decoder_ids}


@pytest.mark.parametrize("family", list(SEQ2SEQ))
def test_sparsify_rewrites_the_encoders_and_the_decoders_ffns(family):
    """BART-style encoder layers take a required attention_mask: their inline FFN is rewritten all the same."""
    model, kwargs = build(family), inputs(build(family))
    with torch.no_grad():
        expected = model(**kwargs).logits
    twell.sparsify(model)
    report = twell.report(model)
    assert [r.path for r in report if r.rewritten] == SEQ2SEQ[family][3], str(report)
    with torch.no_grad():
        torch.testing.assert_close(model(**kwargs).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_calibration_on_token_ids_measures_both_stacks(family):
    """Token-id batches alone: the decoder is fed the ids shifted right, so its FFNs are measured too."""
    model = build(family)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    twell.sparsify(model, [ids, ids[:, :5]])
    records = twell.report(model).records
    assert [r.path for r in records] == SEQ2SEQ[family][3]
    assert all(r.decision["stats"]["prefill"]["rows"] == 2 * 9 + 2 * 5 for r in records), records


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_cli_loads_an_encoder_decoder_checkpoint_whole(family, tmp_path, capsys):
    build(family).save_pretrained(tmp_path / family)
    rc, out, err = run(
        ["report", tmp_path / family, *QUICK[:2], "--seq-len", "8", "--json", tmp_path / "r.json"], capsys
    )
    assert rc == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["model"]["class"] == SEQ2SEQ[family][1]
    records = report["records"]
    assert [r["path"] for r in records] == SEQ2SEQ[family][3]
    assert all(r["decision"]["stats"]["prefill"]["rows"] > 0 for r in records)
