"""Early stopping on the validation loss (train.early_stopping_patience).

LoRA on a small chat set overfits within a few hundred steps: the validation loss turns up while the
training loss keeps falling. Stopping after `patience` evaluations without a new best keeps the run
from training on past that point (the final model is the one at the stopping step, not the best one).
"""

from __future__ import annotations

import math


class EarlyStopping:
    def __init__(self, patience: int):
        self.patience = patience
        self.best = math.inf
        self.bad = 0  # evaluations in a row without a new best

    def should_stop(self, eval_loss: float | None) -> bool:
        """Record one evaluation's loss; True once `patience` evaluations in a row have not improved."""
        if not self.patience or eval_loss is None:
            return False
        if eval_loss < self.best:
            self.best, self.bad = eval_loss, 0
            return False
        self.bad += 1
        return self.bad >= self.patience
