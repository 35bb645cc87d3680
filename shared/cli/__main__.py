"""`python -m tokenyard.cli`: the `tokenyard` command without its script (tests, containers)."""

import sys

from tokenyard.cli import main

sys.exit(main())
