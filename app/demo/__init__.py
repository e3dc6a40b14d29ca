"""The demo: generated faces, the small demo models trained on them, and the files ``rubricsearch demo`` keeps."""

KEY_FILE = "demo-admin-key"  # in the data dir: the admin key the demo generates when none is configured
