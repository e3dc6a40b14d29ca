"""``python -m rubricsearch``: the same entry point as the ``rubricsearch`` console script."""

from rubricsearch.app.cli import main

raise SystemExit(main())
