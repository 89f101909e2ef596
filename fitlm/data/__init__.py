"""Data: the training-time reader, and under fitlm.data.prep the offline preparation that writes what it reads.

Read (this package; imports nothing from prep):
    SequenceLoader(PackedDataset(out_dir), seq_length, micro_batch_size, seed) -> batches  (dataset.py, loader.py,
                                                                                 rows.py)
    Tokenizer.from_file(path)                            -> a model's tokenizer with its BOS/EOS rules (tokenizer.py)
    ChatEncoder(tokenizer, template)                     -> ids + assistant loss mask (chat.py)
    format.py documents the packed directory; gguf_tokenizer.py / gguf_vocab.py read llama.cpp's vocabularies.

Prepare (fitlm.data.prep; `fitlm data clean|tokenizer|pack|merge`):
    clean_corpus(inputs, out_dir, CleanOptions(...))     -> cleaned .jsonl + report
                                                            (clean.py, clean_filters.py, dedup.py)
    train_tokenizer(files, vocab_size, out_path)         -> tokenizer.json            (tokenizer_train.py)
    pack_corpus(inputs, tokenizer_path, out_dir, ...)    -> packed directory          (pack.py, encode.py)
    merge_packed(parts, out_dir)                         -> one packed directory      (merge.py)
    ... engine="ray" on each: Ray Data (ray_session.py, clean_ray.py, pack_ray.py, ray_read.py)
"""

from fitlm.data.conventions import SPECIAL_TOKENS
from fitlm.data.dataset import IGNORE_INDEX, PackedDataset, check_compat
from fitlm.data.errors import DataError
from fitlm.data.format import FORMAT, FORMAT_VERSION
from fitlm.data.loader import SequenceLoader
from fitlm.data.rows import window_order
from fitlm.data.tokenizer import Tokenizer

__all__ = [
    "DataError",
    "FORMAT",
    "FORMAT_VERSION",
    "IGNORE_INDEX",
    "PackedDataset",
    "SPECIAL_TOKENS",
    "SequenceLoader",
    "Tokenizer",
    "check_compat",
    "window_order",
]
