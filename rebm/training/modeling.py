"""The names DAT scripts import (`from rebm.training.modeling import get_model, load_checkpoint`)."""

from rebm.checkpoint.weights import load_checkpoint
from rebm.distributed.parallel import strip_parallel, unwrap
from rebm.engine.build import get_model, get_optimizer

__all__ = ["get_model", "get_optimizer", "load_checkpoint", "strip_parallel", "unwrap"]
