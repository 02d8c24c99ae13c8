"""`spark-server lora pack DIR -o FILE` and `spark-server lora check FILE [--model M]`."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from engine.errors import LoraUnavailableError
from lora_store.pack import build_pack, md5_of, unpack


def add_commands(sub: argparse._SubParsersAction) -> None:
    lora = sub.add_parser("lora", help="build and check LoRA packs")
    cmds = lora.add_subparsers(dest="lora_command", required=True)
    pack = cmds.add_parser("pack", help="build a pack (tar.gz) from a PEFT adapter directory; prints its md5")
    pack.add_argument("dir", type=Path)
    pack.add_argument("-o", "--output", type=Path, required=True)
    pack.set_defaults(func=_pack)
    check = cmds.add_parser("check", help="validate a pack against the served model and say what is wrong")
    check.add_argument("file", type=Path)
    check.add_argument("--model", default=None, help="local HF directory or .gguf (default: the embedded model)")
    check.add_argument("--max-lora-rank", type=int, default=16)
    check.set_defaults(func=_check)


def _pack(args: argparse.Namespace) -> int:
    try:
        md5 = build_pack(args.dir, args.output)
    except LoraUnavailableError as exc:
        print(f"spark-server lora pack: {exc}", file=sys.stderr)
        return 1
    print(f"{args.output}  md5 {md5}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from transformers import AutoConfig

    from engine.lora import read_adapter
    from engine.model_loader import resolve_model_dir

    work = Path(tempfile.mkdtemp(prefix="lora-check-"))
    try:
        adapter = unpack(args.file, work / "adapter")
        config = AutoConfig.from_pretrained(resolve_model_dir(args.model))
        parsed = read_adapter(adapter, args.file.name, config, args.max_lora_rank)
    except LoraUnavailableError as exc:
        print(f"{args.file}: NOT OK ({exc.code}): {exc}")
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    modules = sorted({m for _, m in parsed.weights})
    layers = len({layer for layer, _ in parsed.weights})
    print(f"{args.file}: OK  md5 {md5_of(args.file)}  rank {parsed.rank}  scaling {parsed.scaling:g}  "
          f"modules {', '.join(modules)}  layers {layers}")
    return 0
