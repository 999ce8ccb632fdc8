"""`python -m toolcollapse ...` is the `toolcollapse` command."""

import sys

from toolcollapse.cli import main

sys.exit(main())
