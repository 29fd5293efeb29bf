"""`python -m gateway`: the same command line as `sinkgate`."""

import sys

from gateway.entry import main

sys.exit(main())
