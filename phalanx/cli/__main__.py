"""``python -m phalanx.cli``."""

import sys

try:
    from phalanx.cli.main import run
except KeyboardInterrupt:  # Ctrl-C while phalanx and Ray are imported
    print("phalanx: interrupted by SIGINT (nothing was started)", file=sys.stderr, flush=True)
    sys.exit(130)

run()
