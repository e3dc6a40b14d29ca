"""Image preprocessing into the model's patches, on the CPU or on the model's device."""
