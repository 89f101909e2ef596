"""`fitlm data ...`: the data preparation commands (argument parsing only; the work is in fitlm.data)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fitlm.cli import emit_json, print_table


def add_commands(sub) -> None:
    p = sub.add_parser("data", help="prepare data: tokenizer, pack, inspect")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="STEP")
    q = dsub.add_parser("tokenizer", help="train a byte-level BPE tokenizer (writes tokenizer.json)")
    q.add_argument("inputs", nargs="+", help="text files or directories")
    q.add_argument("--vocab-size", type=int, required=True, help="vocabulary size including special tokens")
    q.add_argument("--out", required=True, help="output tokenizer.json path (or a directory to hold it)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(func=cmd_data_tokenizer)
    q = dsub.add_parser("pack", help="tokenize a corpus into a packed token directory")
    q.add_argument("inputs", nargs="+", help="text (.txt, .jsonl) files or directories")
    q.add_argument("--tokenizer", required=True, help="tokenizer.json (or a directory holding one)")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.add_argument("--split", choices=["blank-lines", "file"], default="blank-lines",
                   help="how .txt files are cut into documents (default blank-lines)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing packed directory")
    q.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")
    q.set_defaults(func=cmd_data_pack)
    q = dsub.add_parser("inspect", help="summarise a packed directory")
    q.add_argument("path", help="packed directory")
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.set_defaults(func=cmd_data_inspect)



def cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from fitlm.data.pack import expand_inputs
    from fitlm.data.tokenizer import Tokenizer, train_tokenizer

    path = train_tokenizer(expand_inputs([Path(p) for p in args.inputs]), args.vocab_size, Path(args.out),
                           show_progress=not args.json, overwrite=args.overwrite)
    tok = Tokenizer.from_file(path)
    summary = {"path": str(path), "vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
               "pad_id": tok.pad_id, "sha256": tok.sha256}
    emit_json(summary) if args.json else print_table("tokenizer written", summary)
    return 0


def cmd_data_pack(args: argparse.Namespace) -> int:
    from fitlm.data.pack import pack_corpus

    manifest = pack_corpus([Path(p) for p in args.inputs], Path(args.tokenizer), Path(args.out), split=args.split,
                           show_progress=not args.json, overwrite=args.overwrite)
    if args.json:
        emit_json(manifest)
    else:
        print_table(f"packed into {args.out}", {k: v for k, v in manifest.items() if not isinstance(v, (list, dict))})
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from fitlm.data.inspect import inspect_packed

    report = inspect_packed(Path(args.path))
    if args.json:
        emit_json(report)
    else:
        print_table(f"packed data {args.path}", {k: v for k, v in report.items() if not isinstance(v, (list, dict))})
        sys.stderr.write("length histogram (tokens per document):\n")
        for row in report["length_histogram"]:
            sys.stderr.write(f"  {row['min']:>7}-{row['max']:<7} {row['count']:>6}\n")
    return 0


