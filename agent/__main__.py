"""`python -m agent` is the `gpuwarden` command."""

import sys

from agent.cli import main

sys.exit(main())
