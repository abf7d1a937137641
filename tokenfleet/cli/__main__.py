"""`python -m tokenfleet.cli`: the `tokenfleet` command."""

from __future__ import annotations

import sys

from tokenfleet.cli.main import main

sys.exit(main())
