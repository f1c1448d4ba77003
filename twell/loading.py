"""Loading local checkpoints and calibration data for the CLI (and anyone else): nothing is downloaded.

    loaded = load_model("path/to/checkpoint")          # or DEMO_MODEL, or None for the demo model
    batches, note = calibration_batches(loaded, data="corpus.jsonl", samples=16, seq_len=128)

A model is a local Hugging Face checkpoint directory (config.json plus *.safetensors or *.bin, sharded
or not), a hub id already in the local Hugging Face cache, or the built-in demo model. The SakanaAI
SparseLM layout (model_type "<base>_sparse_relu", e.g. "llama_sparse_relu", with `sparsity_*` config
fields and `tracker.*` buffers) loads as the base architecture with ReLU FFNs, without remote code:
its MLPs are ReLU-gated whatever its leftover `hidden_act` says, and its tracker holds training
statistics, not weights. Every failure is a LoadError with a one-line message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

DEMO_MODEL = "twell-demo"
SPARSE_RELU_SUFFIX = "_sparse_relu"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class LoadError(ValueError):
    """A model or data file that cannot be used; the message is one line, meant for the user."""


@dataclass
class LoadedModel:
    """A model ready to calibrate: the nn.Module (eval mode), where it came from, and its tokenizer."""

    model: torch.nn.Module
    name: str
    path: Path
    tokenizer: object | None
    vocab_size: int
    max_positions: int | None


def demo_model_dir() -> Path:
    """Directory of the built-in demo model shipped inside the package (see twell/demo/README.md)."""
    return Path(__file__).resolve().parent / "demo"


def resolve_model_path(model: str | None) -> Path:
    """Local directory of `model`: a checkpoint directory, a hub id found in the local cache, or the
    demo model (None or DEMO_MODEL)."""
    if model is None or model == DEMO_MODEL:
        return demo_model_dir()
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{model} is a file, not a checkpoint directory (config.json and weights)")
        if not (path / "config.json").is_file():
            raise LoadError(f"{model} is not a Hugging Face checkpoint: no config.json in it")
        return path
    if _HUB_ID.match(model):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, local_files_only=True))
        except Exception:
            raise LoadError(
                f"{model} is neither a local directory nor in the local Hugging Face cache, and twell downloads "
                f"nothing: fetch it first (hf download {model}) or pass a checkpoint directory"
            ) from None
    raise LoadError(f"{model}: no such directory (and not the demo model {DEMO_MODEL!r})")


def _read_config(path: Path) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"{path / 'config.json'} is not a readable JSON config: {e}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise LoadError(f"{path / 'config.json'} has no model_type: not a Hugging Face model config")
    return config


def _check_weights(path: Path) -> None:
    if any(path.glob("*.safetensors")) or any(path.glob("*.bin")):
        return
    others = sorted({p.suffix for p in path.iterdir() if p.is_file() and p.suffix not in (".json", ".txt", ".md")})
    found = f" (found {', '.join(others)})" if others else ""
    raise LoadError(f"{path}: unsupported checkpoint format: no *.safetensors or *.bin weights{found}")


def _sparse_relu_config(raw: dict):
    """Config of the base architecture for a SparseLM-style "<base>_sparse_relu" config dict."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    base = raw["model_type"].removesuffix(SPARSE_RELU_SUFFIX)
    if base not in CONFIG_MAPPING:
        raise LoadError(f"model type {raw['model_type']!r}: unknown base architecture {base!r}")
    if raw.get("sparsity_gated_mlp", True) is False:
        raise LoadError(f"{raw['model_type']} with sparsity_gated_mlp=false (non-gated FFNs) is not supported")
    fields = {
        k: v
        for k, v in raw.items()
        if not k.startswith("sparsity_") and k not in ("model_type", "auto_map", "architectures")
    }
    if raw.get("sparsity_new_intermediate_size"):
        fields["intermediate_size"] = raw["sparsity_new_intermediate_size"]
    fields["hidden_act"] = "relu"
    return AutoConfig.for_model(base, **fields)


def _is_tracker_key(key: str) -> bool:
    return "tracker" in key.split(".")


def _pick_dtype(raw: dict, device: torch.device, dtype: torch.dtype | None) -> torch.dtype:
    """float32 on the CPU (fast everywhere, exact statistics); the checkpoint's half dtype on a GPU."""
    if dtype is not None:
        return dtype
    if device.type == "cpu":
        return torch.float32
    stored = raw.get("dtype") or raw.get("torch_dtype")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(stored, torch.bfloat16)


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a checkpoint's weights, read from the files' headers (no tensor loaded
    from safetensors; .bin files memory-mapped)."""
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        from safetensors import safe_open

        with safe_open(file, framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if not shapes:
        for file in sorted(path.glob("*.bin")):
            state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
    return shapes


def _mismatch(path: Path, classes, kwargs: dict) -> str:
    """The first tensor whose checkpoint shape differs from what the config builds, with both shapes."""
    from transformers import AutoConfig

    config = kwargs.get("config") or AutoConfig.from_pretrained(path, local_files_only=True)
    stored = _checkpoint_shapes(path)
    for auto in classes:
        try:
            with torch.device("meta"):
                built = auto.from_config(config)
        except ValueError:
            continue
        prefix = f"{built.base_model_prefix}."
        for name, tensor in built.state_dict().items():
            for key in (name, name.removeprefix(prefix), prefix + name):
                if key in stored and stored[key] != tuple(tensor.shape):
                    return f"{key} is {list(stored[key])} in the checkpoint, {list(tensor.shape)} by its config.json"
        break
    return "a tensor's shape differs from the one its config.json gives"


def load_model(model: str | None = None, *, device: str | torch.device = "cpu", dtype=None) -> LoadedModel:
    """Load a local checkpoint (or the demo model) in eval mode on `device`, with no network access."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = resolve_model_path(model)
    raw = _read_config(path)
    _check_weights(path)
    device = torch.device(device)
    dtype = _pick_dtype(raw, device, dtype)
    model_type = raw["model_type"]
    kwargs = {"local_files_only": True, "dtype": dtype, "output_loading_info": True}
    if model_type.endswith(SPARSE_RELU_SUFFIX):
        kwargs["config"] = _sparse_relu_config(raw)
    elif model_type not in CONFIG_MAPPING:
        remote = " (its config asks for remote code, which twell never runs)" if "auto_map" in raw else ""
        raise LoadError(
            f"{path}: unsupported model type {model_type!r}: transformers {transformers.__version__} does not "
            f"know it{remote}"
        )
    # an encoder-decoder as one (both stacks), not its decoder alone as a causal LM
    if raw.get("is_encoder_decoder"):
        classes = (AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, AutoModel)
    else:
        classes = (AutoModelForCausalLM, AutoModel)
    try:
        for auto in classes:
            try:
                module, info = auto.from_pretrained(path, **kwargs)
                break
            except ValueError as e:
                if "Unrecognized configuration class" not in str(e) or auto is classes[-1]:
                    raise
    except LoadError:
        raise
    except Exception as e:
        if "ignore_mismatched_sizes" in str(e):
            raise LoadError(f"{path}: the weights do not fit the config: {_mismatch(path, classes, kwargs)}") from None
        message = " ".join(str(e).split()) or type(e).__name__
        raise LoadError(f"{path}: cannot load the checkpoint: {message[:300]}") from None
    missing = [k for k in info.get("missing_keys", ()) if not _is_tracker_key(k)]
    mismatched = info.get("mismatched_keys", ())
    if missing or mismatched:
        bad = [*missing, *(m[0] if isinstance(m, tuple) else m for m in mismatched)]
        raise LoadError(f"{path}: the weights do not fit the config: {len(bad)} missing or mismatched, e.g. {bad[0]}")
    module = module.to(device).eval()

    config = module.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return LoadedModel(
        model=module,
        name=DEMO_MODEL if path == demo_model_dir() else str(model),
        path=path,
        tokenizer=load_tokenizer(path),
        vocab_size=int(text_config.vocab_size),
        max_positions=getattr(text_config, "max_position_embeddings", None)
        or getattr(text_config, "max_target_positions", None),
    )


def load_tokenizer(path: Path):
    """The checkpoint's own tokenizer when it ships one, else None (byte-level input is used)."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise LoadError(f"{path}: cannot load its tokenizer: {' '.join(str(e).split())[:200]}") from None


def read_texts(path: str | Path) -> list[str]:
    """Texts of a data file: JSON Lines (.jsonl/.ndjson: strings or objects with a "text" field) or plain
    text (one text). Raises LoadError for a missing, unreadable, malformed or empty file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise LoadError(f"data file {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise LoadError(f"data file {path} is not UTF-8 text") from None
    except OSError as e:
        raise LoadError(f"data file {path}: {e.strerror or e}") from None
    if path.suffix.lower() in JSONL_SUFFIXES:
        texts = []
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise LoadError(f"data file {path}, line {number}: not valid JSON") from None
            if isinstance(record, dict):
                record = record.get("text")
            if not isinstance(record, str):
                raise LoadError(f'data file {path}, line {number}: expected a string or an object with a "text" string')
            texts.append(record)
    else:
        texts = [content]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise LoadError(f"data file {path} holds no text")
    return texts


def tokenize(texts: list[str], tokenizer, vocab_size: int) -> list[int]:
    """One token stream: the checkpoint's tokenizer, else UTF-8 bytes (folded into the vocabulary when it
    has fewer than 256 entries); texts are separated by the tokenizer's EOS token or a blank line."""
    if tokenizer is None:
        stream = "\n\n".join(texts).encode("utf-8")
        return [b % vocab_size for b in stream]
    stream: list[int] = []
    separator = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    for text in texts:
        if stream:
            stream += separator
        stream += tokenizer(text, add_special_tokens=False)["input_ids"]
    return stream


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def calibration_batches(
    loaded: LoadedModel,
    *,
    data: str | Path | None = None,
    samples: int = 16,
    seq_len: int = 128,
    batch_size: int = 4,
    seed: int = 0,
) -> tuple[list[torch.Tensor], str]:
    """Batches of token ids [batch, seq] for calibrate(), and a one-line note on where they came from
    (for a speech encoder-decoder, dicts of random audio features and those ids as decoder input).

    With `data`, up to `samples` consecutive windows of `seq_len` tokens of its token stream (fewer when
    the file is short; one shorter window when it is shorter than seq_len). Without, `samples` random
    token sequences: cheap and always available, but real text measures sparsity better.
    """
    for name, value in (("samples", samples), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise LoadError(f"{name} must be a positive integer, got {value!r}")
    if loaded.max_positions and seq_len > loaded.max_positions:
        raise LoadError(f"seq_len {seq_len} exceeds the model's {loaded.max_positions} positions")
    if data is None:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, loaded.vocab_size, (samples, seq_len), generator=gen)
        sequences = _count(samples, "random token sequence")
        note = f"{sequences} of {seq_len}: real text measures sparsity better (--data FILE)"
    else:
        stream = tokenize(read_texts(data), loaded.tokenizer, loaded.vocab_size)
        if len(stream) < 2:
            raise LoadError(f"data file {data} gives fewer than 2 tokens")
        length = min(seq_len, len(stream))
        windows = min(samples, len(stream) // length)
        ids = torch.tensor(stream[: windows * length], dtype=torch.int64).view(windows, length)
        how = "its tokenizer" if loaded.tokenizer is not None else "byte-level"
        note = f"{data}: {_count(windows, 'sequence')} of {length} tokens ({how})"
    batches = list(ids.split(batch_size))
    model = loaded.model
    if getattr(model, "main_input_name", None) == "input_features":
        # a speech encoder-decoder (Whisper): random log-mel features of the encoder's full length, the
        # token ids its decoder's input
        config, gen = model.config, torch.Generator().manual_seed(seed)
        shape = (config.num_mel_bins, 2 * config.max_source_positions)
        dtype = next(model.parameters()).dtype
        batches = [
            {"input_features": torch.randn(len(b), *shape, generator=gen).to(dtype), "decoder_input_ids": b}
            for b in batches
        ]
        note += f"; encoder input: random audio features {list(shape)}"
    return batches, note


__all__ = [
    "DEMO_MODEL",
    "LoadError",
    "LoadedModel",
    "calibration_batches",
    "demo_model_dir",
    "load_model",
    "load_tokenizer",
    "read_texts",
    "resolve_model_path",
    "tokenize",
]
