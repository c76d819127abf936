"""`python -m rebm.eval.table`, the documented path of the paper-table command
(rebm/eval/commands/table.py)."""

import sys

from rebm.eval.commands.table import main

sys.exit(main())
