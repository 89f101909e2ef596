"""Offline data preparation: clean and deduplicate text, train a tokenizer, pack documents into shards, merge
packed parts; each locally or on Ray Data. What it writes, fitlm.data reads (see fitlm/data/__init__.py)."""

from fitlm.data.prep.pack import pack_corpus
from fitlm.data.prep.sources import expand_inputs, iter_documents
from fitlm.data.prep.tokenizer_train import min_vocab_size, train_tokenizer

__all__ = ["expand_inputs", "iter_documents", "min_vocab_size", "pack_corpus", "train_tokenizer"]
