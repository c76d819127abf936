"""Which CPU kernels this machine's PyTorch runs, and whether a forced dispatch took effect.

PyTorch (ATen), oneDNN and MKL each pick their kernels by the CPU's instruction set, each with
its own switch: ATEN_CPU_CAPABILITY (only `default`, `avx2`, `avx512`; anything else is ignored
without a word), ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS. `make test-dispatch` sets all
three below the machine's own and first runs `python -m tests.dispatch`, which fails unless ATen
and oneDNN report the level asked for (a misspelt value would otherwise rerun the native kernels
and prove nothing). MKL is not checked: on AMD CPUs its verbose header and version record name
no instruction set (docs/design.md §7).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List

# One convolution large enough that PyTorch hands it to oneDNN, which then prints its `isa:` line.
_ONEDNN_PROBE = ("import torch; torch.nn.functional.conv2d(torch.rand(8, 16, 32, 32), "
                 "torch.rand(32, 16, 3, 3))")


def aten_capability() -> str:
    """ATen's kernel level: DEFAULT, AVX2, AVX512, ... (torch 2.8 calls the default 'NO AVX')."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return "DEFAULT" if capability == "NO AVX" else capability


def onednn_isa() -> str:
    """oneDNN's instruction set as its verbose mode names it (e.g. 'Intel SSE4.1'), read from a
    fresh interpreter: the verbose line is printed once, at oneDNN's first use in a process."""
    env = dict(os.environ, ONEDNN_VERBOSE="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True,
                         text=True, timeout=120).stdout
    found = re.search(r"info,cpu,isa:(.*)", out)
    return found.group(1).strip() if found else "unknown (oneDNN printed no isa line)"


def _squeezed(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", text.upper())


def mismatches(env: Dict[str, str]) -> List[str]:
    """What `env` asks of ATen and oneDNN and this process does not do (empty: all took)."""
    problems = []
    asked = env.get("ATEN_CPU_CAPABILITY")
    if asked and aten_capability() != asked.upper():
        problems.append(f"ATEN_CPU_CAPABILITY={asked} asked, ATen runs {aten_capability()} "
                        "(ATen accepts only default, avx2, avx512)")
    asked = env.get("ONEDNN_MAX_CPU_ISA")
    if asked:
        isa = onednn_isa()
        if _squeezed(asked.split("_")[0]) not in _squeezed(isa):
            problems.append(f"ONEDNN_MAX_CPU_ISA={asked} asked, oneDNN runs '{isa}'")
    return problems


def main() -> int:
    print(f"CPU dispatch: ATen {aten_capability()}, oneDNN '{onednn_isa()}', MKL asked "
          f"{os.environ.get('MKL_ENABLE_INSTRUCTIONS', 'nothing')} (not checked)")
    problems = mismatches(dict(os.environ))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
