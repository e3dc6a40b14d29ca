"""Ingestion side of rubricsearch: sources, validation, dedup, the catalog and resumable jobs.

Never imports ``app``: workers run without the web stack.
"""
