"""Kernels the accelerated engine swaps into the model's modules (Triton, cuDNN, fused); each checks itself once per
device."""
