"""Data pipeline: train a tokenizer, pack text into token files, read them back as training batches.

    train_tokenizer(files, vocab_size, out_path)        -> tokenizer.json      (tokenizer.py)
    pack_corpus(inputs, tokenizer_path, out_dir)        -> packed directory    (pack.py, format documented there)
    SequenceLoader(PackedDataset(out_dir), seq_length, micro_batch_size, seed)  -> batches  (dataset.py)
"""

from fitlm.data.dataset import IGNORE_INDEX, PackedDataset, SequenceLoader, check_compat, window_order
from fitlm.data.errors import DataError
from fitlm.data.pack import FORMAT, FORMAT_VERSION, expand_inputs, iter_documents, pack_corpus
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
