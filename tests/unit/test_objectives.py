"""finetune.objective as one interface (fitlm.step.objectives): every objective, SFT included, is an object the
step calls without asking which it is."""

from __future__ import annotations

import torch

from fitlm.config import validate_dict
from fitlm.models.loss import IGNORE_INDEX, count_targets
from fitlm.step.objectives import objective_for
from fitlm.step.pair_objectives import PairObjective
from fitlm.step.sft_objective import SFTObjective
from fitlm.train.trainer import Trainer
from tests.e2e.helpers import tiny_config
from tests.unit.test_dpo import MODEL


def test_objective_for_gives_one_for_every_objective():
    base = {"model": MODEL, "data": {"train": "x", "seq_length": 64}}
    # SFT and SimPO read neither the parallel context nor the model
    sft = objective_for(validate_dict(base), None, None)
    assert isinstance(sft, SFTObjective) and sft.metrics == {}
    pairs = {**base, "data": {**base["data"], "format": "preference"}}
    simpo = objective_for(
        validate_dict({**pairs, "finetune": {"objective": "simpo", "simpo": {"gamma": 0.3}}}), None, None
    )
    assert isinstance(simpo, PairObjective) and (simpo.beta, simpo.gamma) == (2.0, 0.3)


def test_sft_counts_target_tokens_and_logs_nothing():
    labels = torch.tensor([[1, IGNORE_INDEX, 3], [IGNORE_INDEX, IGNORE_INDEX, 4]])
    sft = SFTObjective()
    assert sft.count(labels) == count_targets(labels) == 3
    sft.observe(torch.zeros(0))
    assert sft.metrics == {}


def test_the_sft_step_is_the_step_s_token_loss(tiny_corpus, tmp_path):
    trainer = Trainer(validate_dict(tiny_config(tiny_corpus, tmp_path / "out", train={"max_steps": 1})))
    step = trainer.step
    assert isinstance(step.objective, SFTObjective)
    batch = next(trainer._loader(trainer.train_data, shuffle=False))
    input_ids, labels, doc, _ = step.model_inputs(batch)
    with torch.no_grad():
        loss, extra = step.objective.micro_loss(step, input_ids, labels, doc)
        assert torch.equal(loss, step.loss_sum(input_ids, labels, **doc)) and extra.shape == (0,)
    assert torch.equal(step.forward_backward([batch]), loss / float(count_targets(labels)))  # the whole step's mean
