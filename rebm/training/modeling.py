"""`from rebm.training.modeling import get_model, get_optimizer, load_checkpoint`: the import path
of the original DAT code, kept for its scripts; the code is rebm/compat/modeling.py."""

from rebm.compat.modeling import (  # noqa: F401
    __all__,  # noqa: F401
    get_model,
    get_optimizer,
    load_checkpoint,
    strip_parallel,
    unwrap,
)
