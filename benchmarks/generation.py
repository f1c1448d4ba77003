"""Greedy generation for Hugging Face causal LMs with a static KV cache, the decode step replayed as a
CUDA graph: what the model benchmarks time instead of an eager `generate()` loop.

    decoder = GreedyDecoder(model, batch=16, max_len=80)          # graph=True on CUDA
    tokens = decoder.generate(prompt, new_tokens=64)              # [batch, 64], as generate() gives

One decode step (the model on the static token and position buffers and the StaticCache, argmax, the
token written back into the input buffer, the position advanced, all in place) is captured once in a
torch.cuda.CUDAGraph, after warm-up steps on a side stream, and replayed per token: no host work per
token beyond one replay and one copy of the token out. Why a manual graph rather than
torch.compile(mode="reduce-overhead"): it captures any callable unchanged (the eager model, the model
after twell.sparsify, a torch.compile'd model with any backend, the "twell" one included), so the
benchmark rows differ only in the forward they run; reduce-overhead's CUDA-graph trees hand out outputs
that the next step overwrites (which broke it under generate(), benchmarks/decode.py's earlier
measurement) and would recompile per row. transformers' StaticCache suits capture as is: it writes
keys and values with index_copy_ at positions from its own device counter (advanced in place), and
for one-token queries on a static cache it always builds the attention mask from device tensors.
The prompt's forward is not captured (once per generation, and capture needs the cache allocated); it
runs the eager model unless prompt_forward says otherwise.

Needs transformers 5.x. Positions go in as `position_ids` and the cache as `past_key_values` or `cache`
(5.17 and 5.24 name it differently): the same calls generate(greedy, static cache) makes, so the tokens
match it (tests/test_generation.py).
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import StaticCache


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which the model's forward takes its KV cache."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(f"{type(model).__name__}.forward takes no KV cache argument")


class GreedyDecoder:
    """Greedy decoding of `batch` sequences of up to `max_len` tokens (prompt included).

    model: a Hugging Face causal LM (its config and device give the cache). forward: what runs the
    decode step (default: the model; e.g. torch.compile(model)). prompt_forward: what runs the prompt's
    forward (default: `model`, eagerly). graph: replay the decode step as a CUDA graph (CUDA only;
    captured on the first generate).
    """

    def __init__(
        self, model, batch: int, max_len: int, *, forward=None, graph: bool | None = None, prompt_forward=None
    ):
        if int(transformers.__version__.split(".")[0]) < 5:  # 4.x caches take their write positions from the host
            raise RuntimeError(f"transformers {transformers.__version__}: the loop needs 5.x")
        self.model = model
        self.forward = model if forward is None else forward
        self.prompt_forward = model if prompt_forward is None else prompt_forward
        self.device = next(model.parameters()).device
        self.graph = self.device.type == "cuda" if graph is None else graph
        if self.graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        self.max_len = max_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.cache_kwarg = cache_argument(model)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)  # the token fed to the next step
        self.position = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self.captured: torch.cuda.CUDAGraph | None = None

    def _run(self, forward, ids, positions):
        return forward(
            input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **{self.cache_kwarg: self.cache}
        ).logits

    def _step(self) -> None:
        """One decode step on the static buffers: its greedy token becomes the next step's input."""
        logits = self._run(self.forward, self.ids, self.position)
        self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.position.add_(1)

    def _prefill(self, prompt: torch.Tensor) -> None:
        self.cache.reset()
        positions = torch.arange(prompt.shape[1], device=self.device).unsqueeze(0)
        logits = self._run(self.prompt_forward, prompt, positions)
        self.ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.position.fill_(prompt.shape[1])

    def _capture(self, prompt: torch.Tensor) -> None:
        self._prefill(prompt)  # allocates the cache's tensors: they must exist before capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the capture: compilation, autotuning, workspaces
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.captured):
            self._step()

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, after_prompt=None) -> torch.Tensor:
        """prompt: [batch, P] token ids. Returns the `new_tokens` greedy tokens [batch, new_tokens].
        after_prompt: called once the prompt's forward is issued, before the first decode step (a
        benchmark's time stamp between the two)."""
        if prompt.shape[0] != self.ids.shape[0]:
            raise ValueError(f"prompt batch {prompt.shape[0]}, decoder built for {self.ids.shape[0]}")
        if prompt.shape[1] + new_tokens - 1 > self.max_len:
            raise ValueError(f"{prompt.shape[1]} + {new_tokens} tokens exceed the cache's {self.max_len}")
        if self.graph and self.captured is None:
            self._capture(prompt)
        self._prefill(prompt)
        out = torch.empty(prompt.shape[0], new_tokens, dtype=torch.long, device=self.device)
        out[:, 0] = self.ids[:, 0]
        if after_prompt is not None:
            after_prompt()
        for i in range(1, new_tokens):
            if self.captured is not None:
                self.captured.replay()
            else:
                self._step()
            out[:, i] = self.ids[:, 0]
        return out
