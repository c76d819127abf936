"""`python -m rebm.eval.fid_stats`: the documented path of the FID statistics command
(rebm/eval/commands/fid_stats.py)."""

import sys

from rebm.eval.commands.fid_stats import main

if __name__ == "__main__":
    sys.exit(main())
