"""DAT (stage 2): its config rules, objective, step and curriculum."""

from rebm.methods.dat.curriculum import Curriculum
from rebm.methods.dat.dat import DAT, global_aucs_all_ranks
from rebm.methods.dat.objective import TERMS, LossTerm, dat_loss, energy, loss_options
from rebm.methods.dat.rules import energy_bce_weights, raw_energy_bce_weights

__all__ = ["DAT", "TERMS", "Curriculum", "LossTerm", "dat_loss", "energy", "energy_bce_weights",
           "global_aucs_all_ranks", "loss_options", "raw_energy_bce_weights"]
