"""Reading a corpus on Ray Data: one task per input file runs the local engine's own readers
(`fitlm.data.prep.sources`), so both engines cut the same documents, in the same order.

Each row: `gidx` (the document's place in input order: file index << 40 | position in the file),
`text` ("" for rows that only carry the bytes and replaced characters at a file's end), `nbytes` (raw
bytes read since the previous row, for progress) and `replaced` (undecodable bytes replaced in them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fitlm.data.prep.sources import ReadStats, Split, iter_chat, iter_file_documents

FILE_SHIFT = 40  # up to 2^40 documents per file, 2^23 files


def _rows(paths: list[str], split: Split, min_doc_chars: int, chat: bool, first: int) -> Iterator[dict[str, Any]]:
    for i, p in enumerate(paths):
        index, path = first + i, Path(p)
        stats = ReadStats()
        done = 0
        if chat:
            items = (
                (json.dumps(m, ensure_ascii=False) if m is not None else "", n) for m, n in iter_chat([path], stats)
            )
        else:
            items = ((d.text, d.nbytes) for d in iter_file_documents(path, index, split, min_doc_chars, stats))
        for pos, (text, nbytes) in enumerate(items):
            total = sum(stats.replaced.values())
            yield {"gidx": (index << FILE_SHIFT) | pos, "text": text, "nbytes": nbytes, "replaced": total - done}
            done = total


def read_rows(ray: Any, files: Sequence[Path], split: Split, min_doc_chars: int, chat: bool = False) -> Any:
    """A Ray dataset of the documents (or chat records as JSON) of `files`, in input order."""
    items = [{"first": i, "path": str(p)} for i, p in enumerate(files)]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    return ds.flat_map(lambda r: _rows([r["path"]], split, min_doc_chars, chat, r["first"]))


@contextmanager
def ray_texts(files: Sequence[Path], address: str | None, show_progress: bool) -> Iterator[Iterator[str]]:
    """The non-empty documents of `files` (blank-line split, as the tokenizer trainer reads them), in order."""
    from fitlm.data.prep.ray_session import ray_session, reraise_data_error
    from fitlm.data.prep.sources import DEFAULT_MIN_DOC_CHARS

    with ray_session(address, show_progress) as ray:
        ds = read_rows(ray, files, "blank-lines", DEFAULT_MIN_DOC_CHARS)

        def texts() -> Iterator[str]:
            try:
                for b in ds.iter_batches(batch_format="numpy", batch_size=1024):
                    yield from (t for t in b["text"] if t)
            except Exception as e:
                reraise_data_error(e)
                raise

        yield texts()


def add_replaced(stats: ReadStats, files: Sequence[Path], gidx: int, replaced: int) -> None:
    """Count `replaced` characters against the file that the row `gidx` came from."""
    stats.add_replaced(files[gidx >> FILE_SHIFT], int(replaced))


__all__ = ["FILE_SHIFT", "add_replaced", "ray_texts", "read_rows"]
