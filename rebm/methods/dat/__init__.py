"""DAT (stage 2): its config rules, objective, step and curriculum."""

from rebm.methods.dat.curriculum import Curriculum
from rebm.methods.dat.objective import clf_loss, dat_loss, ebm_loss, energy
from rebm.methods.dat.rules import loss_weights, raw_loss_weights
from rebm.methods.dat.step import DAT, dat_step, global_aucs

__all__ = ["DAT", "Curriculum", "dat_step", "clf_loss", "dat_loss", "ebm_loss", "energy",
           "global_aucs", "loss_weights", "raw_loss_weights"]
