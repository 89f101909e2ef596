"""The features the planner sums, one module each (their planner terms: fitlm.plan.terms). A new memory or parallel
feature adds its module and one line here; the engines (fitlm.plan.analytic, fitlm.plan.throughput) and the
search (fitlm.plan.search) read them from this table. The order is the order of their named parts in a report.
"""

from __future__ import annotations

from fitlm.plan import activation_offload, context_parallel, data_parallel, expert_parallel, finetune, grpo, pipeline
from fitlm.plan.terms import Feature

FEATURES: tuple[Feature, ...] = (
    finetune.FEATURE,
    expert_parallel.FEATURE,
    pipeline.FEATURE,
    context_parallel.FEATURE,
    data_parallel.FEATURE,
    activation_offload.FEATURE,
    grpo.FEATURE,
)
