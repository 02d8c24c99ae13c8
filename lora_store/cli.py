"""`spark-server lora pack DIR -o FILE`, `spark-server lora check FILE [--model M]` and
`spark-server lora push FILE --server URL` (publish to a server's pack shelf)."""

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
    push = cmds.add_parser("push", help="publish a pack to a server's shelf (POST /v1/lora/packs); prints the "
                                        "{url, md5} sessions name it by")
    push.add_argument("file", type=Path)
    push.add_argument("--server", required=True, help="the server's base URL, e.g. http://127.0.0.1:9990")
    push.add_argument("--api-key", default=None, help="the server's --api-key (default: $SPARK_API_KEY)")
    push.add_argument("--quiet", action="store_true", help="no progress bar")
    push.set_defaults(func=_push)


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


def _push(args: argparse.Namespace) -> int:
    import json
    import os

    import httpx

    size = args.file.stat().st_size
    key = args.api_key or os.environ.get("SPARK_API_KEY")

    def chunks():
        sent = 0
        with open(args.file, "rb") as fh:
            while chunk := fh.read(1 << 16):
                sent += len(chunk)
                if not args.quiet:
                    done = int(30 * sent / max(size, 1))
                    print(f"\r{args.file.name} [{'#' * done}{'.' * (30 - done)}] {sent >> 10}/{size >> 10} KiB",
                          end="", file=sys.stderr, flush=True)
                yield chunk
        if not args.quiet:
            print(file=sys.stderr)

    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    try:
        r = httpx.post(args.server.rstrip("/") + "/v1/lora/packs", content=chunks(), headers=headers,
                       timeout=httpx.Timeout(600.0, connect=10.0))
    except httpx.HTTPError as exc:
        print(f"spark-server lora push: {args.server}: {exc}", file=sys.stderr)
        return 1
    if r.status_code != 201:
        try:
            why = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = r.text[:300]
        print(f"spark-server lora push: refused ({r.status_code}): {why}", file=sys.stderr)
        return 1
    print(json.dumps({"url": r.json()["url"], "md5": r.json()["md5"]}))
    return 0
