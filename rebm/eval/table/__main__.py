"""`python -m rebm.eval.table ...`: the table runner's command (rebm/eval/table/command.py)."""

import sys

from rebm.eval.table.command import main

sys.exit(main())
