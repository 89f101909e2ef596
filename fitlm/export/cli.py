"""`fitlm export` and `fitlm chat` argument parsing; the work is in hf.py, gguf.py, onnx.py and chat.py."""

from __future__ import annotations

import argparse
import sys


def size(text: str) -> int:
    """--max-shard-size: bytes, or a number with K/M/G (binary: 5GiB = 5G = 5 × 1024³)."""
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        n = int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 5GiB, 500MB or a byte count") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard needs at least 1 byte; write e.g. 5GiB")
    return n


def add_commands(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a model to Hugging Face (safetensors), GGUF or ONNX",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export MODEL (fitlm model dir, training output, HF dir or GGUF file) for "
        "inference. A LoRA adapter given with --adapter is merged first. Every export "
        "records fitlm/torch versions and the source's sha256.",
        epilog="examples:\n"
        "  fitlm export demo/run --format hf --out exports/hf\n"
        "  fitlm export demo/run --format gguf --dtype q8_0 --out exports/model.gguf\n"
        "  fitlm export demo/run --format onnx --dynamic-shape --out exports/model.onnx",
    )
    p.add_argument("model", metavar="MODEL", help="the model to export")
    p.add_argument("--format", required=True, choices=("hf", "gguf", "onnx"), help="output format")
    p.add_argument("--out", required=True, metavar="PATH", help="directory (hf) or file (gguf, onnx) to write")
    p.add_argument("--adapter", metavar="DIR", help="PEFT LoRA adapter to merge into MODEL before exporting")
    p.add_argument(
        "--dtype",
        default="f16",
        choices=("f32", "f16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"),
        help="GGUF weight type (default f16); the k-quants use llama.cpp's quantizer (the llamacpp extra)",
    )
    p.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="GGUF: write the weights without the tokenizer (tokenizer.ggml.model 'none'), e.g. for a "
        "tokenizer llama.cpp has no name for; llama.cpp then takes token ids, not text",
    )
    p.add_argument(
        "--dynamic-shape",
        action="store_true",
        help="ONNX: dynamic batch and sequence axes (default: static [--batch-size, --seq-len])",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="T",
        help="ONNX static sequence length (default: model.max_seq_len)",
    )
    p.add_argument("--batch-size", type=int, default=1, metavar="B", help="ONNX static batch size (default 1)")
    p.add_argument(
        "--max-shard-size",
        type=size,
        default="5GiB",
        metavar="SIZE",
        help="HF: split safetensors above this size, with an index (default 5GiB)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "chat",
        help="chat with a model in the terminal (multi-turn, streaming)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Interactive multi-turn chat using the model's chat template (its "
        "tokenizer_config.json chat_template, else chatml). Type /reset to clear the "
        "history and /exit (or end of input) to quit. Reads turns from stdin, one per line.",
        epilog="example:\n  fitlm chat demo/run\n  printf 'hello\\n/exit\\n' | fitlm chat demo/run",
    )
    p.add_argument("model", metavar="MODEL", help="fitlm model dir, training output dir, or HF dir with a tokenizer")
    p.add_argument("--template", metavar="NAME|FILE", help="chat template: chatml, inst, plain, or a file")
    p.add_argument("--system", metavar="TEXT", help="system message put before the conversation")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="reply length limit (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)")
    p.set_defaults(func=cmd_chat)


def cmd_export(args: argparse.Namespace) -> int:
    from fitlm.cli_common import emit_json, print_table
    from fitlm.export.source import load_for_export, open_for_export

    if args.format == "hf":  # streamed block by block: no process holds the whole model
        from fitlm.export.hf import export_hf

        summary = export_hf(open_for_export(args.model, args.adapter), args.out, max_shard_bytes=args.max_shard_size)
    elif args.format == "gguf":  # streamed too, each tensor encoded as its block arrives
        from fitlm.export.gguf import export_gguf

        summary = export_gguf(
            open_for_export(args.model, args.adapter), args.out, args.dtype, tokenizer=not args.no_tokenizer
        )
    else:  # ONNX loads the whole model: it traces a module
        from fitlm.export.onnx import export_onnx

        summary = export_onnx(
            load_for_export(args.model, args.adapter),
            args.out,
            dynamic_shape=args.dynamic_shape,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
        )
    summary["adapter_merged"] = args.adapter
    emit_json(summary) if args.json else print_table("exported", summary)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from fitlm.export.chat_repl import run_chat

    return run_chat(
        args.model,
        sys.stdin,
        sys.stdout,
        sys.stderr,
        template=args.template,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
