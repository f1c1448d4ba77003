"""The `twell` command line end to end on CPU: tiny checkpoints written to temporary directories, the
built-in demo model, the SparseLM layout, calibration data files, and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import twell  # noqa: E402
from twell.calibrate import load_plan  # noqa: E402
from twell.cli import main  # noqa: E402
from twell.loading import DEMO_MODEL, demo_model_dir, load_model  # noqa: E402
from twell.passes import find_ffns  # noqa: E402

QUICK = ["--samples", "4", "--seq-len", "32"]


@pytest.fixture(autouse=True)
def _restore_environment():
    """main() sets HF_HUB_OFFLINE & co. for its process; keep the test process as it was."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def tiny_config(**overrides):
    fields = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="relu",
        max_position_embeddings=64,
    )
    return transformers.LlamaConfig(**{**fields, **overrides})


def save_tiny(path, **overrides):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config(**overrides)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def relu_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("relu_llama"))


@pytest.fixture(scope="module")
def sparselm(tmp_path_factory):
    """The SakanaAI SparseLM layout: model_type llama_sparse_relu, a leftover hidden_act "silu",
    sparsity_* config fields, remote-code auto_map, and tracker buffers among the weights."""
    path = save_tiny(tmp_path_factory.mktemp("sparselm"), hidden_act="silu")
    config = json.loads((path / "config.json").read_text())
    config.update(
        model_type="llama_sparse_relu",
        architectures=["SparseLlamaForCausalLM"],
        auto_map={"AutoModelForCausalLM": "sparse_models.SparseLlamaForCausalLM"},
        sparsity_l1_coeff=2e-5,
        sparsity_gated_mlp=True,
        sparsity_max_seq_len=2048,
        sparsity_use_hybrid_kernel=False,
        sparsity_tokens_until_dead=None,
    )
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    weights["tracker.last_activated"] = torch.zeros(4, dtype=torch.int64)
    weights["model.layers.0.mlp.tracker.alive"] = torch.ones(128)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(autouse=True)
def _pipe_width(monkeypatch):
    """Off a terminal the report is laid out for 80 columns unless $COLUMNS says otherwise."""
    monkeypatch.delenv("COLUMNS", raising=False)


def run(argv, capsys):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def flat(out):
    """The report's words in one line: the summary panel wraps its texts at the console's width."""
    return " ".join(out.replace("│", " ").split())


def assert_fits_80_columns(out):
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80, out
    assert all(line == line.rstrip() for line in lines), "padded with spaces"


# --- reports and plans ----------------------------------------------------------------------------


def test_report_on_the_demo_model(capsys):
    rc, out, err = run(["report", *QUICK, "--device", "cpu"], capsys)
    assert rc == 0, err
    assert_fits_80_columns(out)
    assert f"twell report: {DEMO_MODEL} (LlamaForCausalLM)" in out
    assert all(f"model.layers.{i}.mlp " in out for i in range(4))
    # random bytes: the demo was trained to stay sparse on them too, every layer is rewritten
    assert "rewrite" in out and "keep dense" not in out and "(1)" not in out
    text = flat(out)
    assert "predicted model speedup" in text and "random token sequences" in text
    assert "an FFN is rewritten when its predicted speedup is at least 1.05x" in text
    assert "on cpu no CUDA GPU: the rewritten model runs the dense path here" in text
    assert "predicted for the GPU the cost model names" in text and "twell kernels on H200" in text


def test_wide_console_shows_every_column(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    rc, out, err = run(["report", *QUICK], capsys)
    assert rc == 0, err
    assert "nnz/row" in out and "tile/slots" in out and "128/16" in out


# Python source, the kind of text the demo model was trained on (examples/train_sparse.py)
PYTHON_TEXT = Path(twell.format.__file__)


def test_demo_model_is_sparse_as_trained(tmp_path, capsys):
    """On Python source the trained demo's first FFN is past the prefill kernels' break-even density
    (0.8%: its prefill calls run dense, predicted 1.00x) but well inside the decode kernels': rewritten
    for its decode steps. The other three are a few tenths of a percent dense and pay in both phases."""
    out_json = tmp_path / "report.json"
    rc, _, err = run(["report", DEMO_MODEL, *QUICK, "--data", PYTHON_TEXT, "--json", out_json], capsys)
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    records = report["records"]
    ffns = [r["decision"] for r in records]
    densities = [f["density"] for f in ffns]
    assert 0.008 < densities[0] < 0.03 and all(d < 0.008 for d in densities[1:]) and sum(densities) / 4 < 0.01
    assert [r["rewritten"] for r in records] == [f["rewrite"] for f in ffns] == [True] * 4
    assert ffns[0]["predicted_speedup"]["prefill"] == 1.0 and ffns[0]["predicted_speedup"]["decode"] > 1.05
    assert all(f["predicted_speedup"]["prefill"] > 1.05 for f in ffns[1:]) and not any(f["dense_phases"] for f in ffns)
    assert all(f["dead_neurons"] > 0 and f["tile_n"] == 128 and f["slots"] == 16 for f in ffns)
    summary = report["summary"]
    assert (summary["candidates"], summary["rewritable"], summary["rewritten"], summary["unmatched"]) == (4, 4, 4, 0)
    # Time shares are measured (so machine-dependent); the summary must be Amdahl over them.
    for phase in ("prefill", "decode"):
        shares = [f["time_share"][phase] for f in ffns]
        assert all(s > 0 for s in shares)
        saved = sum(
            s * (1 - 1 / f["predicted_speedup"][phase]) for s, f in zip(shares, ffns, strict=True) if f["rewrite"]
        )
        assert summary[phase]["ffn_time_share"] == pytest.approx(sum(shares))
        assert summary[phase]["rewritten_time_share"] == pytest.approx(sum(shares))
        assert summary[phase]["speedup"] == pytest.approx(1 / (1 - saved))
    assert summary["prefill"]["speedup"] > 1
    assert summary["min_speedup"] == 1.05 and all(f["min_speedup"] == 1.05 for f in ffns)
    assert ffns[0]["reason"].startswith("predicted ") and "(decode, " in ffns[0]["reason"]
    assert all(
        f["reason"].endswith("reaching the 1.05x threshold") and r["reason"] == ""
        for f, r in zip(ffns, records, strict=True)
    )
    assert summary["decode"]["speedup"] > 1
    assert report["model"]["path"] == str(demo_model_dir())


def test_json_to_stdout(capsys):
    rc, out, _ = run(["report", *QUICK, "--json", "-"], capsys)
    assert rc == 0
    assert json.loads(out)["summary"]["candidates"] == 4


def test_convert_writes_a_plan_that_sparsify_applies(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    rc, out, err = run(["convert", DEMO_MODEL, "--out", plan, *QUICK, "--data", PYTHON_TEXT], capsys)
    assert rc == 0, err
    assert f"plan written to {plan}\n" in out and f"twell.sparsify(model, plan='{plan}')\n" in out
    model = load_model(DEMO_MODEL).model
    decisions = load_plan(plan, find_ffns(model))
    assert [d.rewrite for d in decisions.values()] == [True] * 4
    twell.sparsify(model, plan=plan)
    rewritten = [r["path"] for r in twell.report(model).to_dict()["records"] if r["rewritten"]]
    assert rewritten == [f"model.layers.{i}.mlp" for i in range(4)]


def test_sparselm_layout_loads_as_relu_llama(sparselm, tmp_path, capsys):
    out_json = tmp_path / "report.json"
    rc, out, err = run(["report", sparselm, *QUICK, "--json", out_json], capsys)
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    assert report["model"]["class"] == "LlamaForCausalLM"
    assert [(r["activation"], r["rewritable"]) for r in report["records"]] == [("relu", True)] * 2
    assert all(r["decision"]["stats"]["prefill"]["rows"] == 4 * 32 for r in report["records"])
    model = load_model(str(sparselm)).model
    weights = load_file(sparselm / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items() if "tracker" not in k)


def test_non_relu_model_is_reported_not_rewritable(tmp_path, capsys):
    path = save_tiny(tmp_path / "silu", hidden_act="silu")
    rc, out, err = run(["report", path, *QUICK, "--json", tmp_path / "r.json"], capsys)
    assert rc == 0, err
    assert_fits_80_columns(out)
    # One reason, shared by both layers: a note under the table.
    assert out.count("not rewritable (1)") == 2 and out.count("(1) activation silu is not sparse") == 1
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["summary"]["rewritten"] == 0 and not any(r["rewritable"] for r in report["records"])
    assert all(r["reason"] for r in report["records"])


def test_inline_ffns_are_timed_and_see_decode_steps(tmp_path, capsys):
    """OPT writes its FFN inline in the decoder layer and flattens tokens to [B*T, N]: the decode steps
    are still recognised, and the FFN's time is that of its two linears."""
    config = transformers.OPTConfig(
        vocab_size=96,
        hidden_size=32,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path / "opt")
    rc, out, err = run(["report", tmp_path / "opt", *QUICK, "--json", tmp_path / "r.json"], capsys)
    assert rc == 0, err
    assert "model.decoder.layers.0[fc1,fc2]" in out  # brackets survive rich markup
    assert_fits_80_columns(out)
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    assert [r["path"] for r in records] == ["model.decoder.layers.0[fc1,fc2]", "model.decoder.layers.1[fc1,fc2]"]
    for f in (r["decision"] for r in records):
        assert f["kind"] == "plain" and f["stats"]["decode"]["rows"] == 4 * 4 and f["stats"]["prefill"]["rows"] == 128
        assert set(f["time_share"]) <= {"prefill", "decode"} and f["time_share"]
        assert f["tile_n"] is None or f["tile_n"] <= 128  # no tile wider than the layer


def test_hub_id_found_in_the_local_cache(relu_llama, tmp_path, monkeypatch, capsys):
    """A hub id resolves to its snapshot in the Hugging Face cache, without the network."""
    import shutil

    import huggingface_hub

    revision = "0" * 40
    repo = tmp_path / "hub" / "models--twell-tests--tiny-relu"
    shutil.copytree(relu_llama, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    rc, out, err = run(["report", "twell-tests/tiny-relu", *QUICK], capsys)
    assert rc == 0, err
    assert "twell report: twell-tests/tiny-relu (LlamaForCausalLM)" in out


def test_short_data_gives_fewer_or_shorter_sequences(relu_llama, tmp_path):
    from twell.loading import calibration_batches, tokenize

    loaded = load_model(str(relu_llama))
    data = tmp_path / "short.txt"
    data.write_text("abcdefghij")
    batches, note = calibration_batches(loaded, data=data, samples=8, seq_len=40)
    assert [b.shape for b in batches] == [(1, 10)] and note.endswith(": 1 sequence of 10 tokens (byte-level)")
    assert batches[0][0].tolist() == [b % 96 for b in b"abcdefghij"]  # bytes folded into the 96-token vocabulary
    data.write_text("x" * 100)
    batches, _ = calibration_batches(loaded, data=data, samples=8, seq_len=30, batch_size=2)
    assert [tuple(b.shape) for b in batches] == [(2, 30), (1, 30)]
    assert tokenize(["ab", "c"], None, 256) == [97, 98, 10, 10, 99]
    _, note = calibration_batches(loaded, samples=1, seq_len=8)
    assert note.startswith("1 random token sequence of 8:")


def test_pytorch_bin_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_config())
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    rc, out, err = run(["report", tmp_path, *QUICK], capsys)
    assert rc == 0, err
    assert "model.layers.1.mlp" in out


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_data_files_byte_level(relu_llama, tmp_path, capsys, suffix):
    text = "The quick brown fox jumps over the lazy dog. " * 20
    data = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        data.write_text(json.dumps({"text": text}) + "\n\n" + json.dumps(text) + "\n")
    else:
        data.write_text(text + "\n\n" + text)
    out_json = tmp_path / "r.json"
    rc, _, err = run(
        ["report", relu_llama, "--data", data, "--samples", "3", "--seq-len", "40", "--json", out_json], capsys
    )
    assert rc == 0, err
    report = json.loads(out_json.read_text())
    assert report["data"] == f"{data}: 3 sequences of 40 tokens (byte-level)"
    assert report["records"][0]["decision"]["stats"]["prefill"]["rows"] == 120


def test_data_with_the_checkpoint_tokenizer(relu_llama, tmp_path, capsys):
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path / "with_tokenizer"
    shutil.copytree(relu_llama, path)
    words = "the quick brown fox jumps over lazy dog".split()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(path)
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog " * 5)  # 45 words: 45 tokens
    out_json = tmp_path / "r.json"
    rc, _, err = run(["report", path, "--data", data, "--samples", "8", "--seq-len", "20", "--json", out_json], capsys)
    assert rc == 0, err
    assert json.loads(out_json.read_text())["data"] == f"{data}: 2 sequences of 20 tokens (its tokenizer)"


# --- bad input: one line on stderr, non-zero exit, never a traceback -------------------------------


def _checkpoint_problem(tmp_path, relu_llama, problem):
    """A directory (or path) with one thing wrong, and the message expected for it."""
    import shutil

    path = tmp_path / "model"
    if problem == "missing path":
        return tmp_path / "nowhere", "no such directory"
    if problem == "a file":
        return relu_llama / "config.json", "is a file, not a checkpoint directory"
    if problem == "hub id not cached":
        return "twell-tests/not-a-cached-model", "twell downloads nothing"
    path.mkdir()
    if problem == "no config":
        return path, "no config.json"
    if problem == "config not json":
        (path / "config.json").write_text("{oops")
        return path, "not a readable JSON config"
    if problem == "no model_type":
        (path / "config.json").write_text("{}")
        return path, "has no model_type"
    if problem == "unknown model type":
        (path / "config.json").write_text(json.dumps({"model_type": "frobnicator", "auto_map": {}}))
        (path / "model.safetensors").write_bytes(b"")
        return path, "unsupported model type 'frobnicator'"
    shutil.copytree(relu_llama, path, dirs_exist_ok=True)
    if problem == "no weights":
        (path / "model.safetensors").rename(path / "model.gguf")
        return path, "unsupported checkpoint format: no *.safetensors or *.bin weights (found .gguf)"
    if problem == "corrupt weights":
        (path / "model.safetensors").write_bytes(b"not safetensors at all")
        return path, "cannot load the checkpoint"
    if problem == "weights do not fit":
        config = json.loads((path / "config.json").read_text())
        config["num_hidden_layers"] = 3
        (path / "config.json").write_text(json.dumps(config))
        return path, "the weights do not fit the config"
    raise AssertionError(problem)


CHECKPOINT_PROBLEMS = [
    "missing path",
    "a file",
    "hub id not cached",
    "no config",
    "config not json",
    "no model_type",
    "unknown model type",
    "no weights",
    "corrupt weights",
    "weights do not fit",
]


def assert_one_line_error(rc, err, expected, status=1):
    assert rc == status
    assert err.count("\n") == 1 and err.startswith("twell: error: "), err
    assert "Traceback" not in err
    assert expected in err, err


@pytest.mark.parametrize("problem", CHECKPOINT_PROBLEMS)
def test_bad_checkpoints(tmp_path, relu_llama, capsys, problem):
    model, expected = _checkpoint_problem(tmp_path, relu_llama, problem)
    rc, out, err = run(["report", model, *QUICK], capsys)
    assert_one_line_error(rc, err, expected)
    assert out == ""


@pytest.mark.parametrize(
    ("content", "suffix", "expected"),
    [
        (None, ".txt", "no such file"),
        ("", ".txt", "holds no text"),
        ("  \n\n ", ".txt", "holds no text"),
        ('{"text": "fine"}\n{oops\n', ".jsonl", "line 2: not valid JSON"),
        ('{"content": "no text field"}\n', ".jsonl", 'line 1: expected a string or an object with a "text" string'),
        ("\n\n", ".jsonl", "holds no text"),
        (b"\xff\xfe\x00bad", ".txt", "is not UTF-8 text"),
        ("x", ".txt", "gives fewer than 2 tokens"),
    ],
    ids=["missing", "empty", "blank", "bad-json-line", "no-text-field", "empty-jsonl", "not-utf8", "one-token"],
)
def test_bad_data_files(tmp_path, capsys, content, suffix, expected):
    data = tmp_path / f"data{suffix}"
    if isinstance(content, bytes):
        data.write_bytes(content)
    elif content is not None:
        data.write_text(content)
    rc, _, err = run(["report", "--data", data, *QUICK], capsys)
    assert_one_line_error(rc, err, expected)


@pytest.mark.parametrize(
    ("argv", "expected", "status"),
    [
        (["report", "--bogus"], "unrecognized arguments: --bogus", 2),
        (["frobnicate"], "invalid choice: 'frobnicate'", 2),
        (["convert", DEMO_MODEL], "the following arguments are required: --out", 2),
        (["convert", "--out", "plan.json"], "the following arguments are required: MODEL", 2),
        (["report", "--samples", "0"], "expected a positive integer, got 0", 2),
        (["report", "--seq-len", "many"], "expected a positive integer, got 'many'", 2),
        (["report", "--seq-len", "5000"], "seq_len 5000 exceeds the model's 1024 positions", 1),
    ],
    ids=["unknown-option", "unknown-command", "no-out", "no-model", "zero-samples", "bad-int", "too-long"],
)
def test_bad_arguments(capsys, argv, expected, status):
    rc, _, err = run(argv, capsys)
    assert_one_line_error(rc, err, expected, status)


@pytest.mark.parametrize(
    ("option", "name", "expected"),
    [
        ("--out", "missing/plan.json", "missing does not exist"),
        ("--out", "a-file/plan.json", "a-file is not a directory"),
        ("--out", ".", "is a directory; give a file name"),
        ("--json", "missing/report.json", "missing does not exist"),
    ],
    ids=["out-in-missing-dir", "out-under-a-file", "out-is-a-dir", "json-in-missing-dir"],
)
def test_unwritable_outputs_fail_before_calibrating(tmp_path, monkeypatch, capsys, option, name, expected):
    monkeypatch.setattr("twell.cli.analyse", lambda args: pytest.fail("calibrated before checking the outputs"))
    (tmp_path / "a-file").write_text("")
    out = ["--out", tmp_path / "plan.json"] if option == "--json" else []
    rc, _, err = run(["convert", DEMO_MODEL, *out, option, tmp_path / name], capsys)
    assert_one_line_error(rc, err, expected)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_cuda_without_a_gpu(capsys):
    rc, _, err = run(["report", "--device", "cuda"], capsys)
    assert_one_line_error(rc, err, "no CUDA GPU is available")


def test_the_installed_command_end_to_end(tmp_path):
    """A real process: clean stdout/stderr on success, one line on failure."""
    command = [sys.executable, "-m", "twell.cli"]
    ok = subprocess.run([*command, "report", "--samples", "2", "--seq-len", "16"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert "predicted model speedup" in flat(ok.stdout)
    bad = subprocess.run([*command, "report", str(tmp_path / "missing")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.startswith("twell: error:") and bad.stderr.count("\n") == 1, bad.stderr
    usage = subprocess.run([*command], capture_output=True, text=True)  # no command: a usage error
    assert usage.returncode == 2 and usage.stdout == "" and "report" in usage.stderr and "convert" in usage.stderr


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_closed_pipe_is_a_normal_end(json_out):
    """`twell report | head -1`: the reader is gone before twell writes. Exit 0, nothing on stderr."""
    argv = [sys.executable, "-m", "twell.cli", "report", "--samples", "2", "--seq-len", "16"]
    process = subprocess.Popen(
        argv + (["--json", "-"] if json_out else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    process.stdout.close()
    stderr = process.stderr.read()
    assert (process.wait(), stderr) == (0, "")


def test_modules_not_analysed_are_rows_of_the_table():
    from pathlib import Path

    from rich.console import Console

    from twell.cli import Analysis, render, report_dict
    from twell.loading import LoadedModel
    from twell.passes import Unmatched

    loaded = LoadedModel(torch.nn.Linear(2, 2), "toy[1]", Path("/toy"), None, 256, None)
    unmatched = [Unmatched("blocks.0", "could not trace Block: data-dependent [if]")]
    analysis = Analysis(loaded, [], unmatched, {}, "n", None)
    console = Console(record=True, width=120)
    render(console, analysis)
    text = console.export_text()
    assert "no feed-forward blocks found" not in text
    assert "blocks.0" in text and "not analysed (1)" in text
    assert "(1) could not trace Block: data-dependent [if]" in text
    assert "0 found, 0 rewritable, 0 rewritten; 1 FFN-shaped modules not analysed" in flat(text)
    assert "FFN share of model time not measured" in text
    data = report_dict(analysis)
    (record,) = data["records"]
    assert (record["path"], record["matched"], record["reason"]) == (
        "blocks.0",
        False,
        "could not trace Block: data-dependent [if]",
    )
    assert data["summary"]["candidates"] == 0 and data["summary"]["unmatched"] == 1 and json.dumps(data)


def test_json_records_have_the_fields_of_twell_report(tmp_path, capsys):
    """One schema: `twell report --json` and twell.report(model).to_dict() name every field alike."""
    rc, out, err = run(["report", *QUICK, "--json", "-"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    model = load_model(DEMO_MODEL).model
    api = twell.report(model).to_dict()
    assert [list(r) for r in data["records"]] == [list(r) for r in api["records"]]
    assert set(api["summary"]) <= set(data["summary"])
    assert [r["path"] for r in data["records"]] == [r["path"] for r in api["records"]]


def test_mixture_of_experts_checkpoint_is_reported_per_expert(tmp_path, capsys):
    """Experts stored as 3-D parameters: one row per expert, each measured on the tokens routed to it."""
    config = transformers.MixtralConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="relu",
        max_position_embeddings=64,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "moe")
    rc, out, err = run(["report", tmp_path / "moe", *QUICK, "--json", tmp_path / "r.json"], capsys)
    assert rc == 0, err
    assert all(f"model.layers.0.mlp.experts.{e} " in out for e in range(4))
    records = json.loads((tmp_path / "r.json").read_text())["records"]
    assert [r["path"] for r in records] == [f"model.layers.0.mlp.experts.{e}" for e in range(4)]
    rows = [r["decision"]["stats"]["prefill"]["rows"] for r in records]
    assert sum(rows) == 4 * 32 * 2  # every token reaches two experts
