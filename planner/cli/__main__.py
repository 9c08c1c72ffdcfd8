"""`python -m planner.cli ...` runs the `planner` command."""
import sys

from planner.cli.commands import main

sys.exit(main())
