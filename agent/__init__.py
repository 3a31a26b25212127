"""gpuwarden: the agent runtime (configuration, data model, scheduler, state, command line)."""

import sys

__version__ = "0.1.0"

# structlog imports rich (which brings pygments) and better_exceptions whenever they are
# installed, for console tracebacks gpuwarden never asks for: about 4 MB resident for the
# daemon's whole life on the H200 (docs/MEASUREMENTS.md). Marked absent before structlog
# loads (every gpuwarden entry point imports this package first), so structlog takes its
# plain renderer; a process that imported them already keeps them.
for _optional in ("rich", "better_exceptions"):
    sys.modules.setdefault(_optional, None)  # type: ignore[arg-type]
