"""DPO (`finetune.objective: dpo`): preference packing as TRL tokenizes, pair batches, the reference, and the
first step's loss and rewards against TRL's own DPO loss on the same batch and weights (log-probs computed
independently, by transformers, from the exported policy and reference); bad inputs name the key or line."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fitlm.config import ConfigError, validate_dict
from fitlm.data import DataError, PackedDataset, SequenceLoader, Tokenizer
from fitlm.data.preference import PreferenceEncoder, check_pair
from fitlm.data.prep import pack_corpus
from fitlm.finetune.lora import adapters_off, apply_lora
from fitlm.models.loss import IGNORE_INDEX
from fitlm.step.pair_objectives import pair_terms, sequence_logps
from tests.e2e.helpers import hf_qwen3_moe, read_metrics

PROMPTS = [
    "What is a river?",
    "Who wrote Macbeth?",
    "Name a colour.",
    "Is the sea salty?",
    "What is two plus two?",
    "Where is the moon?",
]
GOOD = ["Water that flows to the sea.", "William Shakespeare.", "Blue.", "Yes, it is.", "Four.", "In the sky."]
BAD = ["A kind of bread.", "Nobody knows.", "Seven.", "No, it is sweet.", "Twenty-two.", "Under the bed."]
MODEL = {
    "arch": "llama",
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_seq_len": 64,
}


def rows() -> list[dict]:
    """Conversational rows (message lists, a string prompt promoted to a user turn) and plain-text rows."""
    out = []
    for i, (p, c, r) in enumerate(zip(PROMPTS, GOOD, BAD)):
        if i % 3 == 2:
            out.append({"prompt": p + " ", "chosen": c, "rejected": r})
        else:
            prompt = [{"role": "user", "content": p}] if i % 3 == 0 else p
            out.append(
                {
                    "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": c}],
                    "rejected": [{"role": "assistant", "content": r}],
                }
            )
    return out


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def pack_pairs(tokenizer, root: Path) -> Path:
    """`rows()` packed as preference pairs under root/packed."""
    src = write_jsonl(root / "pairs.jsonl", rows())
    pack_corpus([src], tokenizer, root / "packed", data_format="preference", max_length=65, show_progress=False)
    return root / "packed"


@pytest.fixture(scope="module")
def packed(tiny_corpus, tmp_path_factory) -> Path:
    return pack_pairs(tiny_corpus["tokenizer"], tmp_path_factory.mktemp("dpo"))


# --------------------------------------------------------------------------- packing and batches


def test_pack_stores_each_pair_as_two_documents_masked_on_the_response(packed):
    ds = PackedDataset(packed)
    assert ds.manifest["preference"]["pairs"] == len(PROMPTS) and ds.num_docs == 2 * len(PROMPTS)
    tok = ds.load_tokenizer()
    for k, (good, bad) in enumerate(zip(GOOD, BAD)):
        for doc, answer in ((2 * k, good), (2 * k + 1, bad)):
            ids, mask = ds.document(doc).tolist(), ds.document_mask(doc).tolist()
            response = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=True)
            assert response.strip().startswith(answer), (doc, response)
            assert ids[-1] in tok.stop_ids and mask[-1] == 1  # the end of the response is learned
            assert mask == sorted(mask)  # prompt (0) then response (1)


def test_loader_yields_pairs_chosen_rows_first(packed, tiny_corpus):
    cfg = validate_dict(
        {
            "model": MODEL,
            "data": {"train": str(packed), "seq_length": 64, "format": "preference"},
            "finetune": {"objective": "dpo"},
        }
    )
    loader = SequenceLoader.from_config(PackedDataset(packed), cfg.data, 2, seed=3)
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 64)  # 2 pairs -> 4 rows
    pairs = loader.windows_for(0, 0)
    for row, doc in enumerate([*(2 * pairs), *(2 * pairs + 1)]):
        n = len(loader.dataset.document(int(doc)))
        assert batch["input_ids"][row, : n - 1].tolist() == loader.dataset.document(int(doc))[: n - 1].tolist()
    prompt_c = batch["labels"][0] == IGNORE_INDEX
    assert torch.equal(batch["input_ids"][0][prompt_c][:3], batch["input_ids"][2][prompt_c][:3])  # same prompt
    with pytest.raises(DataError, match="data.format is 'chat'.*--format preference"):
        SequenceLoader.from_config(PackedDataset(packed), cfg.data.model_copy(update={"format": "chat"}), 2, seed=3)


@pytest.mark.process
def test_tokenization_follows_trl(tmp_path):
    """The prompt/response split TRL's DPO makes (its own tokenize helpers, on a transformers tokenizer of the
    same files), conversational and plain text, including a model that adds BOS."""
    trl_utils = pytest.importorskip("trl.data_utils")
    from transformers import AutoTokenizer

    from fitlm.data.chat import ChatEncoder, resolve_template
    from tests.unit.model_tokenizers import hf_dir

    for style in ("qwen", "llama3"):
        path = hf_dir(style, tmp_path)
        tok, hf = Tokenizer.from_file(path), AutoTokenizer.from_pretrained(path)
        name, source = resolve_template(None, tok.path)
        enc = PreferenceEncoder(tok, ChatEncoder(tok, source, name))
        for record in rows():
            pair = check_pair(record, "row")
            chosen, rejected, shared = enc.encode(pair)
            if pair.conversational:
                prompt = trl_utils._tokenize(hf, pair.prompt, add_generation_prompt=True)["input_ids"]
                full = [trl_utils._tokenize(hf, pair.prompt + r)["input_ids"] for r in (pair.chosen, pair.rejected)]
            else:
                prompt = trl_utils._tokenize(hf, pair.prompt)["input_ids"]
                full = [
                    trl_utils._tokenize(hf, pair.prompt + r + hf.eos_token)["input_ids"]  # TRL adds EOS as text
                    for r in (pair.chosen, pair.rejected)
                ]
            theirs = min(trl_utils.common_prefix_length(prompt, f) for f in full)
            assert (chosen, rejected, shared) == (*full, theirs), (style, record)


# --------------------------------------------------------------------------- the loss and the reference


def test_dpo_pair_terms_are_the_formula():
    policy, ref = torch.tensor([-3.0, -5.0, -4.0, -4.5]), torch.tensor([-3.5, -4.0, -4.2, -4.0])
    loss, chosen, rejected = pair_terms(policy - ref, 0.5)  # DPO: the score is the log-ratio
    margin = 0.5 * ((policy[:2] - ref[:2]) - (policy[2:] - ref[2:]))
    assert torch.allclose(loss, torch.log1p(torch.exp(-margin)))
    assert torch.allclose(chosen - rejected, margin)
    logits = torch.randn(2, 3, 7)
    labels = torch.tensor([[1, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, 6]])
    want = torch.stack(
        [logits[0, 0].log_softmax(-1)[1] + logits[0, 2].log_softmax(-1)[4], logits[1, 2].log_softmax(-1)[6]]
    )
    assert torch.allclose(sequence_logps(logits, labels), want)


def test_adapters_off_is_the_base_model_and_switches_back():
    from fitlm.registry import build_model

    torch.manual_seed(0)
    cfg = validate_dict({"model": MODEL, "data": {"seq_length": 64}})
    model = build_model(cfg.model).eval()
    ids = torch.randint(0, 512, (2, 16))
    base = model(ids)
    apply_lora(model, 4, 8.0, 0.0, ["q_proj", "v_proj"])
    for name, p in model.named_parameters():
        if name.endswith("lora_B.weight"):
            torch.nn.init.normal_(p)  # a trained adapter: the model now differs from its base
    adapted = model(ids)
    assert not torch.allclose(adapted, base)
    with adapters_off(model):
        assert torch.equal(model(ids), base)
    assert torch.equal(model(ids), adapted)


# --------------------------------------------------------------------------- the first step against TRL


def hf_llama(path: Path, seed: int) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=64,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def dpo_config(packed: Path, out: Path, **finetune) -> dict:
    return {
        "model": {"init_from": finetune.pop("init_from")},
        "data": {"train": str(packed), "seq_length": 64, "format": "preference"},
        "finetune": {"objective": "dpo", **finetune},
        "train": {
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "max_steps": 1,
            "lr": 0.0,
            "min_lr": 0.0,
            "warmup_steps": 0,
            "eval_interval": 0,
            "log_interval": 1,
            "seed": 5,
            "output_dir": str(out),
            "progress": False,
            "observe": {"tensorboard": False},
        },
    }


def token_logps(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log p of each next token by a transformers model, [N, T-1], 0 off the completion mask."""
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1].float()
    picked = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return picked * mask[:, 1:]


def first_step_pairs(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's first step as TRL's one [chosen; rejected] batch: (the sequences [2N, T+1], one token longer
    than the step's inputs, and the step's labels [2N, T]), all of its micro batches' chosen rows first."""
    loader = SequenceLoader.from_config(
        PackedDataset(cfg.data.train), cfg.data, cfg.train.micro_batch_size, seed=cfg.train.seed
    )
    micro = [next(loader) for _ in range(cfg.train.gradient_accumulation_steps)]
    halves = [torch.cat([b[key].chunk(2)[h] for b in micro]) for h in (0, 1) for key in ("input_ids", "labels")]
    input_ids, labels = torch.cat(halves[0::2]), torch.cat(halves[1::2])  # [2N, T]: all chosen, then all rejected
    return torch.cat([input_ids, labels[:, -1:].clamp(min=0)], dim=1), labels


def trl_first_step(cfg, policy_dir: Path, reference_dir: Path, beta: float) -> dict[str, float]:
    """TRL's DPO loss and reward metrics (DPOTrainer._compute_loss, run on a stand-in trainer) for the run's first
    step: its micro batches as TRL's [chosen; rejected] batch, log-probs from transformers."""
    import transformers
    from trl import DPOTrainer

    ids, labels = first_step_pairs(cfg)  # TRL's layout: the sequence itself and a completion mask over it
    completion = torch.cat([torch.zeros_like(labels[:, :1]), (labels != IGNORE_INDEX).long()], dim=1)

    class StandIn(torch.nn.Module):
        """What _compute_loss calls as a model: TRL's fused head's outputs, from a transformers model."""

        is_gradient_checkpointing = False

        def __init__(self, path: Path):
            super().__init__()
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()

        def forward(self, **kwargs) -> SimpleNamespace:
            lp = token_logps(self.hf, kwargs["input_ids"], completion)
            zeros = torch.zeros_like(lp)
            return SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    policy, reference = StandIn(policy_dir), StandIn(reference_dir)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t)
    trainer = SimpleNamespace(
        model=policy,
        ref_model=reference,
        accelerator=accelerator,
        aux_loss_enabled=False,
        precompute_ref_logps=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=["sigmoid"],
        loss_weights=[1.0],
        beta=beta,
        use_weighting=False,
        label_smoothing=0.0,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss = DPOTrainer._compute_loss(
        trainer,
        policy,
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion},
        return_outputs=False,
    )
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("rewards/")}
    return {"loss": float(loss), **metrics}


@pytest.mark.process
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_first_step_with_lr_0_and_another_reference_equals_trl(packed, tmp_path, family):
    """Done means: DPO's first-step loss with lr 0 and another model as reference equals an independent
    computation (transformers' log-probs of both exported models, TRL's loss and rewards), for a dense model and
    a mixture of experts (balancing off, as DPO usually wants: the loss is TRL's alone)."""
    pytest.importorskip("trl")
    from fitlm.train.trainer import Trainer

    make = hf_llama if family == "llama" else hf_qwen3_moe
    policy, reference = make(tmp_path / "policy", 1), make(tmp_path / "reference", 2)
    raw = dpo_config(packed, tmp_path / "out", init_from=str(policy), dpo={"beta": 0.5, "reference": str(reference)})
    if family != "llama":
        raw["model"]["moe_balance"] = "none"
    cfg = validate_dict(raw)
    Trainer(cfg).fit()
    ours = read_metrics(tmp_path / "out")[0]
    theirs = trl_first_step(cfg, policy, reference, 0.5)
    assert abs(theirs["loss"] - 0.6931) > 1e-3  # another reference: not the log 2 of a model against itself
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(theirs[key], abs=2e-5), key


# --------------------------------------------------------------------------- bad inputs


def test_bad_rows_and_configs_name_the_line_or_key(tiny_corpus, packed, tmp_path):
    bad = {
        "no_rejected": {"prompt": "hi", "chosen": "yo"},
        "empty": {"prompt": "hi", "chosen": "", "rejected": "no"},
        "no_answer": {
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "user", "content": "x"}],
            "rejected": "no",
        },
    }
    want = {
        "no_rejected": "pairs.jsonl:1: no 'rejected' field",
        "empty": '"chosen" must be a non-empty',
        "no_answer": '"chosen" has no assistant message',
    }
    for name, record in bad.items():
        src = write_jsonl(tmp_path / "pairs.jsonl", [record])
        with pytest.raises(DataError, match=want[name]):
            pack_corpus([src], tiny_corpus["tokenizer"], tmp_path / name, data_format="preference", show_progress=False)
    src = write_jsonl(tmp_path / "pairs.jsonl", rows())
    with pytest.raises(DataError, match="--format preference packs in one part"):  # merge would lose the pairs
        pack_corpus(
            [src],
            tiny_corpus["tokenizer"],
            tmp_path / "part",
            data_format="preference",
            shard_index=0,
            num_shards=2,
            show_progress=False,
        )
    base = {"model": MODEL, "data": {"train": "x", "seq_length": 64}}
    for extra, message in (
        ({"finetune": {"objective": "dpo"}}, "finetune.objective: dpo trains on preference"),
        (
            {"data": {"train": "x", "seq_length": 64, "format": "preference"}},
            "data.format: preference pairs need finetune.objective: dpo",
        ),
        (
            {
                "data": {"train": "x", "seq_length": 64, "format": "preference"},
                "finetune": {"objective": "dpo", "dpo": {"beta": 0}},
            },
            "finetune.dpo.beta: must be positive",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            validate_dict({**base, **extra})
    chat = validate_dict({"model": MODEL, "data": {"train": str(packed), "seq_length": 64, "format": "chat"}})
    with pytest.raises(DataError, match="packed with --format preference"):
        SequenceLoader.from_config(PackedDataset(packed), chat.data, 2, seed=1)


# --------------------------------------------------------------------------- data parallel and ZeRO (slow)


def _dp_worker(rank: int, world: int, port: int, cases: dict, out_dir: str) -> None:
    from fitlm.parallel.mesh import exit_process
    from fitlm.train.trainer import Trainer

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    results = {name: Trainer(validate_dict(cfg)).fit().history for name, cfg in cases.items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    exit_process(0)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "full"])
def test_data_parallel_and_zero_equal_one_process(packed, tmp_path, method):
    """The step's loss is the mean over all of its pairs: dp2 (ZeRO 0, 2 and 3) with one pair per rank and micro
    batch equals one process with two, step after step (lr > 0, so the updates are compared too)."""
    from fitlm.train.trainer import Trainer
    from tests.distributed.spawn import run_world

    policy = hf_llama(tmp_path / "policy", 1)

    def case(name: str, micro: int, parallel: dict) -> dict:
        cfg = dpo_config(packed, tmp_path / name, init_from=str(policy), method=method)
        cfg["train"].update(micro_batch_size=micro, max_steps=3, lr=1e-2)
        return {**cfg, "parallel": parallel}

    single = Trainer(validate_dict(case("single", 2, {}))).fit().history
    for z in (0, 2, 3):  # a world per run: a process group is not set up again on the same port reliably
        name = f"zero{z}"
        cases = {name: case(name, 1, {"data_parallel": 2, "zero_stage": z})}
        (ranks := tmp_path / f"{name}-ranks").mkdir()
        history = run_world(_dp_worker, __name__, 2, cases, ranks, 200, "DPO data-parallel workers")[0][name]
        assert len(history) == len(single) == 3, name
        for ref, got in zip(single, history):
            for key in ("loss", "rewards/margins", "rewards/accuracies", "grad_norm"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), (name, got["step"], key)
