"""Graph passes: find feed-forward blocks, check them, rewrite them to torch.ops.twell.*.

Contract with twell.calibrate:

    find_ffns(model) -> list[Candidate]   every FFN found, rewritable or not, in module order

Candidate fields: path, kind ("gated" | "plain"), activation, rewritable, reason, gate_module (the
nn.Linear whose output, [..., N] pre-activation, is thresholded; a plain FFN's up linear), gate_slice
(for a fused gate_up linear, the slice of its last dim that is the gate), measure (None, or for one
expert of a mixture-of-experts layer: (args, kwargs, output) of a gate_module call -> that expert's
pre-activation, None when no token was routed to it), threshold, hidden_size (N), model_size (K).
Inline FFNs (written in a bigger module's forward, like OPT's fc1/fc2) have the path
"<module path>[<up>,<down>]" (gated: "[<gate>,<up>,<down>]"); experts stored as 3-D parameters have one
candidate per expert, "<experts module path>.<expert index>". Further fields (owner, spec, inline,
activation_children) are the rewrite's own.

Modules: match (the graph matcher shared by every entry point), candidates (per-module tracing),
modules (what sparsify swaps in), projections (nn.Linear and Conv1D), experts (mixture-of-experts layers),
rewrite (swapping), backend (torch.compile backend and Inductor pass), decided (sparsify's decisions
and the backend's records, by gate weight).
"""

from twell.passes.candidates import Candidate, Unmatched, find_ffns, scan

__all__ = ["Candidate", "Unmatched", "find_ffns", "scan"]
