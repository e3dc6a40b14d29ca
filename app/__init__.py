"""rubricsearch application layer: settings, FastAPI assembly, REST routers, CLI."""
