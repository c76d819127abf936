"""`python -m rebm.eval.counterfactuals`: the documented path of the counterfactual FID's
per-class statistics command (rebm/eval/commands/class_stats.py)."""

import sys

from rebm.eval.commands.class_stats import main

if __name__ == "__main__":
    sys.exit(main())
