"""train.host_allocator: `reuse` stops glibc's malloc from returning freed blocks to the kernel, so a step that
allocates what the step before freed takes no page faults. Measured in child processes (the setting is
process-wide): minor page faults of the median allocate / touch / free cycle of 4-64 MiB tensors. The median, not
the mean: the kernel may page out the kept heap once (DAMON reclaim on a VM faulted a kept 64 MiB block back in
during one CI run, 16,384 faults in one cycle of ten), which says nothing about what each step pays."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fitlm.host_allocator import apply_host_allocator, glibc

CHILD = """
import resource, sys, torch
from fitlm.host_allocator import keep_freed_memory
if sys.argv[1] == "reuse":
    assert keep_freed_memory()
elif sys.argv[1].endswith(".yaml"):  # a Trainer built from this config decides
    from fitlm.config import load_config
    from fitlm.train.trainer import Trainer
    Trainer(load_config(sys.argv[1]))
def cycle():
    xs = [torch.ones(n) for n in (2**20, 4 * 2**20, 16 * 2**20, 3 * 2**20)]  # 4, 16, 64, 12 MiB, touched
    del xs
for _ in range(3):
    cycle()
faults = []
for _ in range(11):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cycle()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[len(faults) // 2])  # the median cycle
"""

needs_glibc = pytest.mark.skipif(glibc() is None, reason="glibc's malloc only (Linux)")


def _faults_per_cycle(kind: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.process
@needs_glibc
def test_reuse_removes_the_page_faults_of_each_cycle():
    system, reuse = _faults_per_cycle("system"), _faults_per_cycle("reuse")
    # 96 MiB touched per cycle = 24,576 pages of 4 KiB: glibc's default maps the large ones afresh every time.
    assert system > 5_000, system
    assert reuse < 100, reuse


@pytest.mark.process
@needs_glibc
@pytest.mark.parametrize("kind", ["reuse", "system"])
def test_a_trainer_on_cpu_sets_it(tiny_corpus, tmp_path, kind):
    from tests.e2e.helpers import tiny_config, write_config

    cfg = write_config(tmp_path / "c.yaml", tiny_config(tiny_corpus, tmp_path / "out", train={"host_allocator": kind}))
    faults = _faults_per_cycle(str(cfg))
    assert (faults < 100) if kind == "reuse" else (faults > 5_000), faults


def test_it_applies_only_to_cpu_training_outside_zero_2_3():
    assert not apply_host_allocator("system", "cpu", fsdp_sharded=False)
    assert not apply_host_allocator("reuse", "cuda", fsdp_sharded=False)
    assert not apply_host_allocator("reuse", "cpu", fsdp_sharded=True)


def test_config_names_the_key():
    from fitlm.config import ConfigError, validate_dict

    assert validate_dict({}).train.host_allocator == "reuse"
    with pytest.raises(ConfigError, match="train.host_allocator"):
        validate_dict({"train": {"host_allocator": "jemalloc"}})
