"""Model plumbing: checkpoints, loading and the official prompts; knows nothing of batching or kernels' use."""
