"""memory.compile's scope (fitlm.memory.compile): the whole model, loss included, where the layout allows;
per block where something wraps or splits the blocks afterwards. The trainer-level check that compiled
training gives eager's losses is tests/unit/test_memory.py::test_compile_matches_eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fitlm.config import MemoryConfig, ModelConfig
from fitlm.memory.chunked_loss import apply_chunked_loss
from fitlm.memory.compile import apply_compile, compiled_whole, compiles_whole_model
from fitlm.memory.recompute import transformer_blocks
from fitlm.parallel_dims import ParallelDims
from fitlm.registry import build_model

TINY = ModelConfig(
    arch="llama",
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    vocab_size=96,
    max_seq_len=16,
    tie_embeddings=False,
)


class Recorder:
    """A torch.compile backend that keeps every graph dynamo captures and runs it as captured (no inductor)."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def tiny_batch():
    torch.manual_seed(0)
    ids = torch.randint(0, TINY.vocab_size, (2, 16))
    labels = torch.randint(0, TINY.vocab_size, (2, 16))
    labels[0, :3] = -100
    return ids, labels


@pytest.mark.process
def test_one_process_compiles_one_graph_from_ids_to_loss():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager, model = build_model(TINY), build_model(TINY)
    model.load_state_dict(eager.state_dict())
    memory = MemoryConfig(compile=True, loss_chunk_size=12)  # 32 tokens: chunks of 12, 12, 8
    rec = Recorder()
    apply_compile(model, memory, ParallelDims(), backend=rec)
    apply_chunked_loss(model, memory.loss_chunk_size, compiled=True)  # traced into the model's graph
    apply_chunked_loss(eager, memory.loss_chunk_size)
    ids, labels = tiny_batch()
    loss = model(ids, labels=labels)
    loss.backward()
    ref = eager(ids, labels=labels)
    ref.backward()
    # One graph, no break: the embedding, every block, the final norm and the chunked loss (its autograd
    # Function) are all in it, and every parameter is one of its inputs.
    assert compiled_whole(model) and len(rec.graphs) == 1, [g.code for g in rec.graphs]
    (graph,) = rec.graphs
    targets = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert F.embedding in targets and torch.ops.higher_order.autograd_function_apply in targets
    assert sum(n.op == "placeholder" for n in graph.graph.nodes) >= len(list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "memory, dims",
    [
        (MemoryConfig(compile=True, recompute="selective"), ParallelDims()),  # checkpoint wraps each block
        (MemoryConfig(compile=True), ParallelDims(dp=2, zero_stage=2)),  # FSDP2 shards each block
        (MemoryConfig(compile=True), ParallelDims(tp=2)),  # DTensor blocks
        (MemoryConfig(compile=True), ParallelDims(pp=2)),  # a stage is a slice of the blocks
    ],
)
def test_layouts_that_wrap_or_split_blocks_compile_per_block(memory, dims):
    model = build_model(TINY)
    assert not compiles_whole_model(memory, dims)
    apply_compile(model, memory, dims, backend=Recorder())
    assert not compiled_whole(model)
    assert all(compiled_whole(block) for block in transformer_blocks(model))


def test_whole_model_wherever_no_block_is_wrapped_after_compile():
    on = MemoryConfig(compile=True)
    assert compiles_whole_model(on, ParallelDims())  # one process
    assert compiles_whole_model(on, ParallelDims(dp=2))  # DDP wraps the compiled model as a whole
    assert compiles_whole_model(on, ParallelDims(dp=2, zero_stage=1))  # ZeRO-1: DDP + sharded optimizer
    assert not compiles_whole_model(MemoryConfig(), ParallelDims())
    model = build_model(TINY)
    apply_compile(model, MemoryConfig(), ParallelDims())  # compile off: nothing compiled
    assert not compiled_whole(model) and not any(compiled_whole(b) for b in transformer_blocks(model))
