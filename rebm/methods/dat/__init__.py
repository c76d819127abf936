"""DAT (stage 2): its config rules, objective, step and curriculum."""

from rebm.methods.dat.curriculum import Curriculum
from rebm.methods.dat.dat import DAT, global_aucs_all_ranks
from rebm.methods.dat.objective import clf_loss, dat_loss, ebm_loss, energy
from rebm.methods.dat.rules import loss_weights, raw_loss_weights

__all__ = ["DAT", "Curriculum", "clf_loss", "dat_loss", "ebm_loss", "energy",
           "global_aucs_all_ranks", "loss_weights", "raw_loss_weights"]
