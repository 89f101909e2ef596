"""Reward functions of the README's GRPO example: TRL's signature, (prompts, completions, **columns) -> one
float (or None) per completion. `columns` holds every other column of the prompt rows (here `topic`)."""


def e_share(prompts, completions, **columns):
    """The share of the letter e in the completion: a dense signal a tiny model can learn within minutes."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def mentions_topic(prompts, completions, topic, **columns):
    """1.0 when the completion names the row's topic, else 0.0."""
    return [float(t in c.lower()) for c, t in zip(completions, topic)]
