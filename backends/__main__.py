"""``python -m backends --role prefill --port 0``: one node (same flags as ``prefixgate node``)."""

from backends.cli import main

raise SystemExit(main())
