"""``python -m prefixgate.backends --role prefill --port 0``: one node (same flags as ``prefixgate node``)."""

from prefixgate.backends.cli import main

raise SystemExit(main())
