"""`python -m rebm.eval.evaluate` that also writes the side of every batch its model was given,
for tests/test_ood.py: `python -m tests.evaluate_recording_input_sides SIDES_JSON CONFIG
model.ckpt_path=PATH ... --ood`. The model is rebm's own, loaded by the entry point's own
`load_eval_model`; a forward pre-hook only notes each input's (height, width), and the sorted
distinct sides go to SIDES_JSON when the command returns. What the hook sees is what reached the
model: the test images, the attacked ones, and the OOD images of `ood` and `ood_sets`."""

from __future__ import annotations

import json
import sys
from typing import List, Set, Tuple

from rebm.eval import evaluate, evaluator


def main(argv: List[str]) -> int:
    sides_path, rest = argv[0], argv[1:]
    seen: Set[Tuple[int, int]] = set()
    load = evaluator.load_eval_model

    def load_and_watch(*args, **kwargs):
        model = load(*args, **kwargs)
        model.register_forward_pre_hook(
            lambda module, inputs: seen.add(tuple(int(n) for n in inputs[0].shape[-2:])))
        return model

    # the command imports load_eval_model from rebm.eval.evaluator when it runs
    evaluator.load_eval_model = load_and_watch
    code = evaluate.main(rest)
    with open(sides_path, "w") as f:
        json.dump(sorted(seen), f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
