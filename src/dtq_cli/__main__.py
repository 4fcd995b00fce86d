"""``python -m dtq_cli``: the same as the ``dtq`` executable; ``dtq dev`` starts children so."""

from dtq_cli.cli import main

raise SystemExit(main())
