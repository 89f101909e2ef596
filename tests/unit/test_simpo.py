"""SimPO (`finetune.objective: simpo`): the length-normalized pair loss on hand-made numbers, the first step's
loss and rewards against TRL's CPOTrainer (loss_type "simpo": its own `get_batch_logps(average_log_prob=True)`,
`cpo_loss` and metrics, on log-probs transformers computes from the same weights and batch), the config checks,
and the planner (2 rows per pair, no reference). The pair machinery it shares with DPO is tested in test_dpo."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fitlm.config import ConfigError, validate_dict
from fitlm.models.loss import IGNORE_INDEX
from fitlm.step.pair_objectives import average_logps, pair_terms
from tests.e2e.helpers import read_metrics
from tests.unit.test_dpo import MODEL, dpo_config, first_step_pairs, hf_llama, pack_pairs

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.fixture(scope="module")
def pairs(tiny_corpus, tmp_path_factory) -> Path:
    return pack_pairs(tiny_corpus["tokenizer"], tmp_path_factory.mktemp("simpo"))


def simpo_config(packed: Path, out: Path, init_from: str, **simpo) -> dict:
    cfg = dpo_config(packed, out, init_from=init_from)
    cfg["finetune"] = {"objective": "simpo", "simpo": simpo}
    return cfg


# --------------------------------------------------------------------------- the loss


def test_simpo_terms_are_the_formula():
    """−log σ(β·(avg chosen − avg rejected) − γ) per pair, rewards β·avg; the average divides each row's summed
    log-prob by its own count of target tokens."""
    logits = torch.randn(4, 5, 7)
    labels = torch.full((4, 5), IGNORE_INDEX)
    for row, n in enumerate((3, 1, 2, 5)):  # responses of different lengths
        labels[row, 5 - n :] = (torch.arange(n) + row) % 7
    lp = logits.log_softmax(-1)
    summed = torch.stack(
        [sum(lp[r, t, labels[r, t]] for t in range(5) if labels[r, t] != IGNORE_INDEX) for r in range(4)]
    )
    avg = average_logps(logits, labels)
    assert torch.allclose(avg, summed / torch.tensor([3.0, 1.0, 2.0, 5.0]))
    avg = torch.tensor([-1.0, -2.5, -1.5, -2.0])  # chosen (2 pairs), then rejected
    loss, chosen, rejected = pair_terms(avg, 2.0, 0.5)  # SimPO: the score is the average log-prob, margin γ
    want = -torch.log(torch.sigmoid(torch.tensor([2.0 * (-1.0 + 1.5) - 0.5, 2.0 * (-2.5 + 2.0) - 0.5])))
    assert torch.allclose(loss, want) and torch.allclose(chosen, 2.0 * avg[:2]) and torch.equal(rejected, 2 * avg[2:])


# --------------------------------------------------------------------------- the first step against TRL


def trl_simpo_first_step(cfg, policy_dir: Path) -> dict[str, float]:
    """TRL's SimPO loss and reward metrics for the run's first step: CPOTrainer.get_batch_loss_metrics run on a
    stand-in trainer, whose concatenated forward is TRL's get_batch_logps(average_log_prob=True) on transformers'
    logits of all the step's micro batches as one [chosen; rejected] batch."""
    import transformers
    from trl.experimental.cpo import CPOTrainer

    ids, labels = first_step_pairs(cfg)  # TRL's layout: labels aligned with ids (get_batch_logps shifts them)
    trl_labels = torch.cat([torch.full_like(labels[:, :1], -100), labels], dim=1)
    model = transformers.LlamaForCausalLM.from_pretrained(policy_dir).eval()
    with torch.no_grad():
        logits = model(ids).logits.float()

    def concatenated_forward(_model, _batch):
        logps = CPOTrainer.get_batch_logps(logits, trl_labels, average_log_prob=True)  # as loss_type simpo asks
        chosen, rejected = logps.chunk(2)
        return chosen, rejected, logits.chunk(2)[0], logits.chunk(2)[1], torch.zeros(())

    s = cfg.finetune.simpo
    trainer = SimpleNamespace(
        loss_type="simpo",
        beta=s.beta,
        simpo_gamma=s.gamma,
        label_smoothing=0.0,
        alpha=0.0,
        cpo_alpha=0.0,
        aux_loss_enabled=False,
        concatenated_forward=concatenated_forward,
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t),
    )
    trainer.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(trainer, c, r)
    loss, metrics = CPOTrainer.get_batch_loss_metrics(trainer, None, {})
    return {"loss": float(loss), **{k: metrics[k] for k in REWARDS}}


def test_first_step_with_lr_0_equals_trl_cpo_simpo(pairs, tmp_path):
    """Done means: SimPO's first-step loss and rewards with lr 0 equal TRL's CPOTrainer (loss_type simpo,
    cpo_alpha 0) on transformers' logits of the exported weights; the step trains on both rows of each pair."""
    pytest.importorskip("trl.experimental.cpo")
    from fitlm.train.trainer import Trainer

    policy = hf_llama(tmp_path / "policy", 1)
    cfg = validate_dict(simpo_config(pairs, tmp_path / "out", str(policy), beta=2.5, gamma=0.8))
    Trainer(cfg).fit()
    ours = read_metrics(tmp_path / "out")[0]
    theirs = trl_simpo_first_step(cfg, policy)
    assert ours["tokens"] == 2 * 2 * 2 * 64  # pairs × 2 rows × accumulation × seq_length
    assert abs(theirs["rewards/margins"]) > 1e-3 and theirs["rewards/accuracies"] not in (0.0, 1.0)
    for key in ("loss", *REWARDS):
        assert ours[key] == pytest.approx(theirs[key], abs=2e-5), key


# --------------------------------------------------------------------------- config and planner


def test_config_names_the_keys_and_rules_refuse_what_dpo_refuses():
    base = {"model": MODEL, "data": {"train": "x", "seq_length": 64, "format": "preference"}}
    cfg = validate_dict({**base, "finetune": {"objective": "simpo"}})
    assert (cfg.finetune.simpo.beta, cfg.finetune.simpo.gamma) == (2.0, 0.5)
    for extra, message in (
        (
            {"data": {"train": "x", "seq_length": 64}, "finetune": {"objective": "simpo"}},
            "finetune.objective: simpo trains on preference pairs but data.format is 'pretrain'",
        ),
        ({"finetune": {"objective": "sft"}}, "need finetune.objective: dpo or simpo"),
        ({"finetune": {"objective": "simpo", "simpo": {"beta": 0}}}, "finetune.simpo.beta: must be positive"),
        (
            {"finetune": {"objective": "simpo"}, "parallel": {"tensor_parallel": 2}},
            "finetune.objective: simpo scores whole sequences on one rank",
        ),
        (
            {"finetune": {"objective": "simpo"}, "memory": {"loss_chunk_size": 32}},
            "finetune.objective: simpo needs each sequence's own log-probability",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            validate_dict({**base, **extra})


def test_plan_doubles_the_rows_and_adds_no_reference():
    from fitlm.plan import finetune as ft
    from fitlm.plan.analytic import breakdown
    from fitlm.plan.devices import CATALOG
    from fitlm.plan.finetune import REFERENCE
    from fitlm.plan.report import plan
    from fitlm.plan.setup import from_config, matmul_params
    from fitlm.plan.throughput import timing

    def setup(objective: str):
        return from_config(
            validate_dict(
                {
                    "model": MODEL,
                    "finetune": {"objective": objective},
                    "train": {"micro_batch_size": 2},
                    "data": {"seq_length": 64, "format": "preference"},
                }
            )
        )

    simpo, dpo = setup("simpo"), setup("dpo")  # full fine-tuning: DPO keeps a frozen copy
    assert simpo.rows == dpo.rows == 4 and simpo.tokens_per_step == dpo.tokens_per_step
    assert ft.reference_bytes(simpo) == 0 < ft.reference_bytes(dpo)
    assert ft.reference_forward_flops(simpo, matmul_params(simpo)) == 0
    ours, theirs = breakdown(simpo), breakdown(dpo)
    assert (ours.activations, ours.logits) == (theirs.activations, theirs.logits)  # 2B rows, whole logits
    assert REFERENCE not in dict(ours.other_parts) and ours.total < theirs.total
    dev = CATALOG["a100-80g"]
    assert timing(simpo, dev).compute_s < timing(dpo, dev).compute_s  # no reference forward
    report = plan(simpo.cfg, dev, 1)["finetune"]
    assert report["simpo"] == {"rows_per_micro_batch": 4, "reference_bytes": 0} and "dpo" not in report


# --------------------------------------------------------------------------- data parallel and ZeRO (slow)


@pytest.mark.slow
def test_data_parallel_and_zero_equal_one_process(pairs, tmp_path):
    """The loss is the mean over all of the step's pairs, as DPO's (the same PairObjective weighting): dp2 under
    ZeRO 0 and 3, one pair per rank and micro batch, equals one process with two, step after step (lr > 0)."""
    from fitlm.train.trainer import Trainer
    from tests.distributed.spawn import run_world
    from tests.unit.test_dpo import _dp_worker

    policy = hf_llama(tmp_path / "policy", 1)

    def case(name: str, micro: int, parallel: dict) -> dict:
        cfg = simpo_config(pairs, tmp_path / name, str(policy))
        cfg["train"].update(micro_batch_size=micro, max_steps=3, lr=1e-2)
        return {**cfg, "parallel": parallel}

    single = Trainer(validate_dict(case("single", 2, {}))).fit().history
    for z in (0, 3):
        name = f"zero{z}"
        (ranks := tmp_path / f"{name}-ranks").mkdir()
        history = run_world(
            _dp_worker,
            "tests.unit.test_dpo",
            2,
            {name: case(name, 1, {"data_parallel": 2, "zero_stage": z})},
            ranks,
            200,
            "SimPO data-parallel workers",
        )[0][name]
        assert len(history) == len(single) == 3, name
        for ref, got in zip(single, history):
            for key in ("loss", "rewards/margins", "rewards/accuracies", "grad_norm"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), (name, got["step"], key)
