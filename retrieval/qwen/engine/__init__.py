"""The execution engine: batched, packed and graphed tower and LM passes over visual packages."""
