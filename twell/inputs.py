"""Calibration data checked against the model it will run, before any of it runs.

    batches = check_batches(model, data)    # a list; ValueError/TypeError naming what was expected

Each batch is a token-id tensor ([batch, seq] or [seq]) or a dict of forward kwargs. A bad batch fails
here in one line (which batch, what it holds, what the model expects) rather than deep inside the
model: token ids outside the vocabulary (an embedding's IndexError), an empty batch (a reshape error),
a dict without the model's input (transformers' message about input_ids and inputs_embeds).

An encoder-decoder model (config.is_encoder_decoder: T5, BART, Whisper ...) runs both stacks: a batch
without decoder inputs gets decoder_input_ids, its token ids shifted right behind the decoder start
token, so calibration measures the decoder's FFNs as well as the encoder's (calibration_config:
without cached decode steps).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

import torch
from torch import nn

_DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def _vocab_size(model: nn.Module) -> int | None:
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    if isinstance(embeddings, nn.Embedding):
        return embeddings.num_embeddings
    return getattr(getattr(model, "config", None), "vocab_size", None)


def _main_input(model: nn.Module) -> str:
    """The name of the model's main input: transformers' main_input_name, else forward's first argument."""
    name = getattr(model, "main_input_name", None)
    if isinstance(name, str):
        return name
    parameters = list(inspect.signature(model.forward).parameters)
    return parameters[0] if parameters else "input"


def _check_ids(ids: torch.Tensor, what: str, vocab: int | None) -> None:
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() not in (1, 2):
        raise ValueError(f"{what} must hold token ids [batch, seq] or [seq] (int64), got {ids.dtype} {list(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"{what} is empty (shape {list(ids.shape)}): expected at least one token per sequence")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        expected = f"[0, {vocab})" if vocab is not None else "non-negative ids"
        raise ValueError(
            f"{what} holds token ids from {low} to {high}: expected ids in {expected}, the model's vocabulary"
        )


def _decoder_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [batch, seq] shifted right behind the decoder start token (as for training with labels=ids),
    cut to the decoder's positions."""
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None) or 0
    decoder = torch.cat([ids.new_full((ids.shape[0], 1), start), ids[:, :-1]], dim=1)
    limit = getattr(config, "max_target_positions", None)
    return decoder[:, :limit] if isinstance(limit, int) else decoder


def calibration_config(model: nn.Module, config):
    """`config` (a CalibrationConfig, a dict of its fields, or None) for calibrating `model`: an
    encoder-decoder runs no cached decode steps (calibration's decode loop feeds a decoder-only model's
    input_ids and cache; an encoder-decoder's decoder needs decoder_input_ids and the encoder's output),
    so its prefill call measures both stacks."""
    from twell.calibrate import CalibrationConfig

    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return config
    return dataclasses.replace(CalibrationConfig.coerce(config), decode_steps=0)


def check_batches(model: nn.Module, data) -> list:
    """The batches of `data` (an iterable of token-id tensors or dicts of forward kwargs), checked
    against `model`; an encoder-decoder's batches get decoder_input_ids where they have no decoder
    input. Raises ValueError / TypeError naming the batch, what it holds and what was expected."""
    if isinstance(data, (torch.Tensor, Mapping)) or not hasattr(data, "__iter__"):
        raise TypeError(
            f"calibration data must be an iterable of batches (a list of token-id tensors or of dicts of "
            f"forward kwargs), got {type(data).__name__}"
        )
    vocab = _vocab_size(model)
    main = _main_input(model)
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    batches = []
    for i, batch in enumerate(data):
        what = f"calibration batch {i}"
        if isinstance(batch, torch.Tensor):
            _check_ids(batch, what, vocab)
            batch = batch if batch.dim() == 2 else batch.unsqueeze(0)
            if seq2seq:
                batch = {"input_ids": batch}
        elif isinstance(batch, Mapping):
            inputs = [main, "inputs_embeds"] if main == "input_ids" else [main]
            if not any(k in batch for k in inputs):
                raise ValueError(
                    f"{what} is a dict with keys {sorted(batch)}: expected the model's input under "
                    f"{' or '.join(repr(k) for k in inputs)} (and other forward arguments of {type(model).__name__})"
                )
            for key in ("input_ids", "decoder_input_ids"):
                if isinstance(batch.get(key), torch.Tensor):
                    _check_ids(batch[key], f"{what}[{key!r}]", vocab)
        else:
            raise TypeError(
                f"{what} is a {type(batch).__name__}: expected a token-id tensor [batch, seq] or a dict of "
                "forward kwargs"
            )
        if seq2seq and not any(k in batch for k in _DECODER_INPUTS):
            if not isinstance(batch.get("input_ids"), torch.Tensor):
                raise ValueError(
                    f"{what}: {type(model).__name__} is an encoder-decoder model; give its decoder inputs "
                    "(decoder_input_ids) with the encoder's"
                )
            batch = {**batch, "decoder_input_ids": _decoder_ids(model, batch["input_ids"])}
        batches.append(batch)
    if not batches:
        raise ValueError("calibration data is empty: give at least one batch")
    return batches


__all__ = ["calibration_config", "check_batches"]
