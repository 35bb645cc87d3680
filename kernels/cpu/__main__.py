"""`python -m tokenyard.kernels.cpu`: build the CPU kernels now (set-up runs it once)."""

import sys

from tokenyard.kernels.cpu import ops

if ops() is None:
    print("CPU kernels not built: the engine will use the torch path", file=sys.stderr)
    sys.exit(0)
print("CPU kernels ready")
