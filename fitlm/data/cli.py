"""`fitlm data ...`: the data preparation commands (argument parsing only; the work is in fitlm.data)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fitlm.cli_common import emit_json, print_table
from fitlm.data.prep.dedup import DEFAULT_JACCARD, DEFAULT_NUM_PERM


def add_commands(sub) -> None:
    p = sub.add_parser("data", help="prepare data: clean, tokenizer, pack, merge, inspect")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="STEP")

    _add_clean(dsub)
    _add_tokenizer(dsub)
    _add_pack(dsub)
    _add_merge(dsub)
    _add_inspect(dsub)


def _add_clean(dsub) -> None:
    q = dsub.add_parser("clean", help="normalise, filter and deduplicate text into cleaned .jsonl")
    q.add_argument("inputs", nargs="+", help=".txt/.jsonl/.parquet files or directories")
    q.add_argument("--out", required=True, help="output directory (clean-00000.jsonl ... + report.json)")
    _split_option(q)
    q.add_argument("--min-doc-chars", type=int, default=2000, help="blank-line blocks are joined up to this size")
    q.add_argument("--normalize", default="NFKC", help="Unicode normal form: NFKC (default), NFC or none")
    q.add_argument("--min-chars", type=int, default=50, help="drop documents shorter than this")
    q.add_argument("--max-garbled", type=float, default=0.01, help="max share of U+FFFD/private-use/unassigned chars")
    q.add_argument("--max-symbols", type=float, default=0.3, help="max share of punctuation and symbols")
    q.add_argument("--min-letters", type=float, default=0.4, help="min share of letters or digits (any script)")
    q.add_argument("--max-dup-lines", type=float, default=0.3, help="max share of characters in repeated lines")
    q.add_argument("--min-compress", type=float, default=0.2, help="min zlib ratio (lower = repetitive)")
    q.add_argument("--drop-code", action="store_true", help="drop documents that are mostly source code")
    q.add_argument("--drop-boilerplate", action="store_true", help="remove boilerplate lines (cookies, log in, ...)")
    q.add_argument("--no-exact-dedup", action="store_true", help="keep exact duplicates")
    q.add_argument("--no-near-dedup", action="store_true", help="keep near duplicates")
    q.add_argument(
        "--jaccard",
        type=float,
        default=DEFAULT_JACCARD,
        help=f"near-duplicate threshold: estimated Jaccard of per-line character n-gram sets (default "
        f"{DEFAULT_JACCARD}: finds copies with up to 3%% of their characters edited)",
    )
    q.add_argument(
        "--num-perm", type=int, default=DEFAULT_NUM_PERM, help=f"MinHash permutations (default {DEFAULT_NUM_PERM})"
    )
    q.add_argument(
        "--ngram",
        type=int,
        help="shingle size in characters (default: 5 in spaced scripts, 3 in Chinese, Japanese, Thai, ...)",
    )
    _engine_options(q)
    q.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    q.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    q.set_defaults(func=cmd_data_clean)


def _add_tokenizer(dsub) -> None:
    q = dsub.add_parser("tokenizer", help="train a byte-level BPE (or import a tokenizer.json / SentencePiece .model)")
    q.add_argument("inputs", nargs="+", help="text files or directories; or one tokenizer.json / .model to import")
    q.add_argument("--vocab-size", type=int, help="vocabulary size including special tokens (training)")
    q.add_argument("--out", required=True, help="output tokenizer.json path (or a directory to hold it)")
    for k in ("bos", "eos", "pad"):
        q.add_argument(f"--{k}", help=f"name of an existing token to use as {k.upper()} (import)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing tokenizer.json")
    _engine_options(q)
    q.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    q.set_defaults(func=cmd_data_tokenizer)


def _add_pack(dsub) -> None:
    q = dsub.add_parser("pack", help="tokenize a corpus into a packed, sharded token directory")
    q.add_argument("inputs", nargs="+", help="text (.txt, .jsonl, .parquet) or chat (.jsonl) files or directories")
    q.add_argument("--tokenizer", required=True, help="tokenizer.json (or a directory holding one)")
    q.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    q.add_argument(
        "--format",
        choices=["text", "chat", "preference", "prompts"],
        default="text",
        help="text documents, chat conversations, preference pairs (prompt/chosen/rejected, for DPO), or "
        "prompts (prompt or messages plus reward columns, for GRPO)",
    )
    q.add_argument(
        "--template",
        help="chat template: chatml, inst (= llama2 [INST]), plain, a tokenizer_config.json "
        "or a .jinja file (default: the tokenizer's chat_template, else chatml)",
    )
    q.add_argument(
        "--max-length",
        type=int,
        help="chat: longest conversation in tokens (e.g. data.seq_length + 1); "
        "preference: longest prompt + response (longer pairs are dropped); "
        "prompts: longest prompt (finetune.grpo.max_prompt_length; longer prompts are refused)",
    )
    q.add_argument(
        "--overlong",
        choices=["truncate", "drop"],
        default="truncate",
        help="chat: what to do with a conversation over --max-length (default truncate)",
    )
    _split_option(q)
    q.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1; Ray: concurrent tasks)")
    q.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    q.add_argument("--shard-index", type=int, help="pack only every num-shards-th input file, from this index")
    q.add_argument("--num-shards", type=int, help="number of parts the inputs are split into (one per machine)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing packed directory")
    _engine_options(q)
    q.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")
    q.set_defaults(func=cmd_data_pack)


def _add_merge(dsub) -> None:
    q = dsub.add_parser("merge", help="join packed directories (e.g. the parts of a split pack) into one")
    q.add_argument("inputs", nargs="+", help="packed directories")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--no-verify", action="store_true", help="skip re-checking the parts' checksums")
    q.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    q.add_argument("--json", action="store_true", help="print the manifest as JSON on stdout")
    q.set_defaults(func=cmd_data_merge)


def _add_inspect(dsub) -> None:
    q = dsub.add_parser("inspect", help="summarise a packed directory and decode a sample")
    q.add_argument("path", help="packed directory")
    q.add_argument("--doc", type=int, default=0, help="document to decode (default 0)")
    q.add_argument("--tokens", type=int, default=64, help="tokens of it to decode (default 64)")
    q.add_argument("--verify", action="store_true", help="recompute every checksum (reads all the data)")
    q.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    q.set_defaults(func=cmd_data_inspect)


def _split_option(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--split",
        choices=["blank-lines", "file", "line"],
        default="blank-lines",
        help="how .txt files are cut into documents: blank-line blocks (default), whole file, or one "
        "document per line (review and web-text dumps)",
    )


def _engine_options(q: argparse.ArgumentParser) -> None:
    q.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local (default: this machine's processes) or ray (Ray Data; pip install 'fitlm[ray]')",
    )
    q.add_argument(
        "--ray-address",
        help="with --engine ray: a Ray cluster to run on (e.g. ray://head:10001 or auto; "
        "default: a local Ray on this machine)",
    )


def cmd_data_clean(args: argparse.Namespace) -> int:
    from fitlm.data.prep.clean import CleanOptions, clean_corpus

    opts = CleanOptions(
        normalize=args.normalize,
        min_chars=args.min_chars,
        max_garbled=args.max_garbled,
        max_symbols=args.max_symbols,
        min_letters=args.min_letters,
        max_dup_lines=args.max_dup_lines,
        min_compress=args.min_compress,
        drop_code=args.drop_code,
        drop_boilerplate=args.drop_boilerplate,
        exact_dedup=not args.no_exact_dedup,
        near_dedup=not args.no_near_dedup,
        jaccard=args.jaccard,
        num_perm=args.num_perm,
        ngram=args.ngram,
    )
    report = clean_corpus(
        args.inputs,
        args.out,
        opts,
        split=args.split,
        min_doc_chars=args.min_doc_chars,
        show_progress=not args.json,
        overwrite=args.overwrite,
        engine=args.engine,
        ray_address=args.ray_address,
    )
    if args.json:
        emit_json(report)
    else:
        rows = {
            k: report[k]
            for k in (
                "documents_in",
                "documents_out",
                "replaced_invalid_utf8",
                "control_chars_removed",
                "documents_normalized",
            )
        }
        rows.update({f"dropped: {k}": v for k, v in report["dropped"].items()})
        print_table(f"cleaned into {args.out}", rows)
    return 0


def cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from fitlm.data.errors import DataError
    from fitlm.data.prep.sources import expand_inputs
    from fitlm.data.prep.tokenizer_train import train_tokenizer
    from fitlm.data.tokenizer import Tokenizer
    from fitlm.data.tokenizer_import import import_tokenizer, is_tokenizer_file

    inputs = [Path(p) for p in args.inputs]
    if len(inputs) == 1 and is_tokenizer_file(inputs[0]):
        if not inputs[0].exists():
            raise DataError(f"tokenizer {inputs[0]} does not exist; pass an existing tokenizer.json or .model file")
        path = import_tokenizer(
            inputs[0], Path(args.out), overwrite=args.overwrite, bos=args.bos, eos=args.eos, pad=args.pad
        )
    else:
        if args.vocab_size is None:
            raise DataError(
                "--vocab-size is required to train a tokenizer (e.g. --vocab-size 32000); to import one, "
                "pass a single tokenizer.json or SentencePiece .model"
            )
        path = train_tokenizer(
            expand_inputs(inputs),
            args.vocab_size,
            Path(args.out),
            show_progress=not args.json,
            overwrite=args.overwrite,
            engine=args.engine,
            ray_address=args.ray_address,
        )
    tok = Tokenizer.from_file(path)
    summary = {
        "path": str(path),
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "sha256": tok.sha256,
    }
    emit_json(summary) if args.json else print_table("tokenizer written", summary)
    return 0


def cmd_data_pack(args: argparse.Namespace) -> int:
    if args.format == "prompts":
        return _pack_prompts(args)
    from fitlm.data.prep.pack import pack_corpus
    from fitlm.data.prep.pack_options import PackOptions

    options = PackOptions(
        split=args.split,
        show_progress=not args.json,
        overwrite=args.overwrite,
        data_format=args.format,
        template=args.template,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
        shard_index=args.shard_index,
        num_shards=args.num_shards,
        max_length=args.max_length,
        overlong=args.overlong,
        engine=args.engine,
        ray_address=args.ray_address,
    )
    manifest = pack_corpus([Path(p) for p in args.inputs], Path(args.tokenizer), Path(args.out), options)
    _print_manifest(args, manifest, f"packed into {args.out}")
    return 0


def _pack_prompts(args: argparse.Namespace) -> int:
    """--format prompts: small prompt sets, checked and encoded in this process (fitlm.data.prompts)."""
    from fitlm.data.errors import DataError
    from fitlm.data.prompts import pack_prompts

    if args.engine != "local" or args.workers != 1 or args.num_shards is not None:
        raise DataError("--format prompts packs in this process; drop --engine ray, --workers and --num-shards")
    manifest = pack_prompts(
        [Path(p) for p in args.inputs],
        Path(args.tokenizer),
        Path(args.out),
        args.template,
        args.max_length,
        args.overwrite,
    )
    if args.json:
        emit_json(manifest)
    else:
        rows = {k: v for k, v in manifest.items() if not isinstance(v, (list, dict)) and v is not None}
        rows["columns"] = ", ".join(manifest["columns"]) or "none"
        print_table(f"packed into {args.out}", rows)
    return 0


def cmd_data_merge(args: argparse.Namespace) -> int:
    from fitlm.data.prep.merge import merge_packed

    manifest = merge_packed(args.inputs, args.out, overwrite=args.overwrite, verify=not args.no_verify)
    _print_manifest(args, manifest, f"merged into {args.out}")
    return 0


def _print_manifest(args: argparse.Namespace, manifest: dict, title: str) -> None:
    if args.json:
        emit_json(manifest)
        return
    rows = {k: v for k, v in manifest.items() if not isinstance(v, (list, dict)) and v is not None}
    rows["shards"] = len(manifest["shards"])
    rows.update({f"chat: {k}": v for k, v in (manifest.get("chat") or {}).items()})
    rows.update({f"preference: {k}": v for k, v in (manifest.get("preference") or {}).items()})
    print_table(title, rows)


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from fitlm.data.inspect import inspect_packed

    report = inspect_packed(Path(args.path), sample_tokens=args.tokens, sample_doc=args.doc, verify=args.verify)
    if args.json:
        emit_json(report)
    else:
        print_table(
            f"packed data {args.path}",
            {k: v for k, v in report.items() if not isinstance(v, (list, dict)) and not k.startswith("sample")},
        )
        sys.stderr.write("length histogram (tokens per document):\n")
        for row in report["length_histogram"]:
            sys.stderr.write(f"  {row['min']:>7}-{row['max']:<7} {row['count']:>6}\n")
        sys.stderr.write(f"document {report['sample_doc']}, first {len(report['sample_token_ids'])} tokens:\n")
        sys.stderr.write(report["sample_text"] + "\n")
        if "sample_trained_text" in report:
            sys.stderr.write("trained (assistant) tokens of it:\n" + report["sample_trained_text"] + "\n")
    return 0
