"""The model core's lower half: typed model configuration, the runtime seam and the local torch runtime."""
