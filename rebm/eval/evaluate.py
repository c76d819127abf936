"""`python -m rebm.eval.evaluate`: the documented path of the evaluate command
(rebm/eval/commands/evaluate.py)."""

import sys

from rebm.eval.commands.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
