"""Triton kernels for TwELL FFNs and the torch.ops.twell.* registration (twell.kernels.library)."""
