"""`python -m agent` is the `gpuwarden` command."""

import sys

from agent.program.cli import main

sys.exit(main())
