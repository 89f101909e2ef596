"""Data pipeline: clean text, train or import a tokenizer, pack documents into shards, read them back as batches.

    clean_corpus(inputs, out_dir, CleanOptions(...))     -> cleaned .jsonl + report   (clean.py, dedup.py, shingles.py)
    ... engine="ray" on clean_corpus / train_tokenizer / pack_corpus: Ray Data (engine.py, clean_ray.py, pack_ray.py)
    train_tokenizer(files, vocab_size, out_path)         -> tokenizer.json            (tokenizer.py)
    pack_corpus(inputs, tokenizer_path, out_dir, ...)    -> packed directory          (pack.py; format.py documents it)
    merge_packed(parts, out_dir)                         -> one packed directory      (merge.py)
    SequenceLoader(PackedDataset(out_dir), seq_length, micro_batch_size, seed)  -> batches  (dataset.py, loader.py)
    ChatEncoder(tokenizer, template)                     -> ids + assistant loss mask (chat.py)
"""

from fitlm.data.dataset import IGNORE_INDEX, PackedDataset, check_compat
from fitlm.data.errors import DataError
from fitlm.data.format import FORMAT, FORMAT_VERSION
from fitlm.data.loader import SequenceLoader, window_order
from fitlm.data.pack import pack_corpus
from fitlm.data.sources import expand_inputs, iter_documents
from fitlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, min_vocab_size, train_tokenizer

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
    "expand_inputs",
    "iter_documents",
    "min_vocab_size",
    "pack_corpus",
    "train_tokenizer",
    "window_order",
]
