"""`python -m gateway`: the same command line as `sinkgate`."""

import sys

from gateway.cli import main

sys.exit(main())
