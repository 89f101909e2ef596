"""`fitlm import` and `fitlm merge` argument parsing; the work is in importer.py and merge.py."""

from __future__ import annotations

import argparse


def add_commands(sub) -> None:
    p = sub.add_parser(
        "import",
        help="convert an HF directory or GGUF file into a fitlm model directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Convert a pretrained model into a fitlm model directory (weights, config, tokenizer).\n"
        "SRC: a Hugging Face safetensors directory (llama, mistral, SmolLM, gpt2) or a "
        "GGUF file (dequantized to float).\nNothing in SRC is executed; pickled .bin "
        "weights are refused unless --weights-only is given.",
        epilog="examples:\n  fitlm import ./SmolLM2-135M --out models/smollm\n"
        "  fitlm import model-Q8_0.gguf --out models/from-gguf",
    )
    p.add_argument("src", metavar="SRC", help="Hugging Face directory or .gguf file")
    p.add_argument("--out", required=True, metavar="DIR", help="fitlm model directory to write")
    p.add_argument(
        "--weights-only",
        action="store_true",
        help="read pytorch_model.bin with torch.load(weights_only=True) (tensors only, no code)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "merge",
        help="fold a LoRA adapter into its base model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Merge a PEFT-format LoRA adapter (a training run's adapter/, or one made with "
        "peft) into MODEL: W + (alpha/r)·B·A, in fp32.",
        epilog="example:\n  fitlm merge models/base --adapter runs/lora/adapter --out models/merged",
    )
    p.add_argument("model", metavar="MODEL", help="the base model the adapter was trained on")
    p.add_argument(
        "--adapter",
        required=True,
        metavar="DIR",
        help="adapter directory (adapter_config.json + adapter_model.safetensors)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="fitlm model directory to write")
    p.add_argument("--json", action="store_true", help="print one JSON summary object on stdout")
    p.set_defaults(func=cmd_merge)


def _report(title: str, summary: dict, as_json: bool) -> int:
    from fitlm.cli_common import emit_json, print_table

    emit_json(summary) if as_json else print_table(title, summary)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from fitlm.finetune.importer import import_model

    return _report("imported", import_model(args.src, args.out, weights_only=args.weights_only), args.json)


def cmd_merge(args: argparse.Namespace) -> int:
    from fitlm.finetune.merge import merge_model

    return _report("merged", merge_model(args.model, args.adapter, args.out), args.json)
