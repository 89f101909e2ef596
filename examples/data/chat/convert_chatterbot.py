"""Rebuild chatterbot_corpus.jsonl from the chatterbot-corpus wheel on PyPI (BSD-licensed; see LICENSE.md).

    pip download --no-deps chatterbot-corpus==1.2.0 -d /tmp/cc
    python examples/data/chat/convert_chatterbot.py /tmp/cc/chatterbot_corpus-1.2.0-py2.py3-none-any.whl

Each YAML conversation [q, a, q, a, ...] becomes one {"messages": [...]} line, user and assistant
alternating; English and Chinese topics are kept (multi-turn where the corpus has it).
"""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import yaml

LANGS = ("english", "chinese")
SYSTEM = {"english": "You are a friendly, concise assistant.", "chinese": "你是一个友好、简洁的助手。"}


def main(wheel: str) -> None:
    out = Path(__file__).with_name("chatterbot_corpus.jsonl")
    rows = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            parts = name.split("/")
            if len(parts) != 4 or parts[2] not in LANGS or not name.endswith(".yml"):
                continue
            data = yaml.safe_load(z.read(name).decode("utf-8"))
            for conv in data.get("conversations") or []:
                turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
                if len(turns) < 2:
                    continue
                turns = turns[: len(turns) // 2 * 2]  # end on an assistant turn
                msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
                if len(rows) % 3 == 0:  # a third get a system prompt, so templates see both shapes
                    msgs.insert(0, {"role": "system", "content": SYSTEM[parts[2]]})
                rows.append({"messages": msgs, "source": f"{parts[2]}/{parts[3]}"})
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} conversations -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
