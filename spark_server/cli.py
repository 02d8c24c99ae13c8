"""``spark-server``: serve the model, with Spark and bridge endpoints on one port."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import io
import logging
import socket
import sys
import time

from spark_server import launch_compat
from spark_server import settings as settings_mod


def _log_native_faults() -> None:
    """A fault in native code (the fused kernels, torch) ends the process at once: leave each thread's
    Python stack on stderr instead of a silent exit. A host whose stderr has no descriptor (an in-process
    capture) keeps its own arrangement."""
    if faulthandler.is_enabled():
        return
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def _hash_model_early(settings: settings_mod.Settings) -> None:
    """A model file not hashed before (its content digest keys every cache made from it) starts hashing now,
    on a thread that reads and hashes without the GIL: a first start's seconds of imports then pass beside
    the hash rather than before it."""
    if settings.engine_url:
        return
    from engine.file_identity import digest_in_background
    from engine.model_loader import default_cache_dir, gguf_source

    try:
        gguf = gguf_source(settings.model)
    except (OSError, RuntimeError):
        return  # no such model: the load says so in its own words
    if gguf is not None:
        digest_in_background(gguf, default_cache_dir())


def _serve(args: argparse.Namespace) -> int:
    launch = launch_compat.Launch()  # what vLLM's and FastDeploy's flags did here
    try:
        settings, sources = settings_mod.resolve_with_sources(vars(args), launch=launch)
    except (ValueError, OSError) as exc:
        print(f"spark-server: {exc}", file=sys.stderr)
        return 2
    _hash_model_early(settings)

    from engine.async_engine import AsyncEngine
    from spark_server.app import LOG_FORMAT, SPARK_WS_PATH, build_app, uvicorn_config
    from spark_server.shutdown import DrainingServer

    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    _log_native_faults()
    logging.getLogger("spark_server").info("%s", settings_mod.describe(settings, sources,
                                                                     everything=settings.log_level == "debug"))
    for level, line in launch.notes:  # one line per foreign flag given: what it does here, or why it is ignored
        logging.getLogger("spark_server.launch").log(level, "%s", line)
    problem = port_problem(settings.host, settings.port)
    if problem:  # before minutes of model loading
        print(f"spark-server: cannot serve on {settings.host}:{settings.port}: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    gc.disable()  # loading builds ~350,000 objects that live as long as the process; no collections walk them meanwhile
    try:
        engine = settings.remote_engine() if settings.engine_url else AsyncEngine.from_config(settings.engine_config())
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"spark-server: cannot load the model: {exc}", file=sys.stderr)
        return 2
    finally:
        gc.enable()
    try:
        launch.check_model(engine.model_info.path)
    except ValueError as exc:
        print(f"spark-server: {exc}", file=sys.stderr)
        return 2
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        print("spark-server: --ssl-certfile and --ssl-keyfile go together", file=sys.stderr)
        return 2
    try:
        app = build_app(settings, engine, protocol_overrides=launch.protocol_options())
    except ValueError as exc:  # e.g. a malformed --spark-auth or --lora
        print(f"spark-server: {exc}", file=sys.stderr)
        return 2
    frozen = settle_startup_heap()
    logging.getLogger("spark_server").info("start-up heap: %d objects frozen out of the cyclic collector's walks",
                                           frozen)
    scheme = "wss" if settings.ssl_certfile else "ws"
    url = f"{scheme}://{settings.host}:{settings.port}{SPARK_WS_PATH}"
    print(f"spark-server: {engine.model_info.name} loaded in {time.monotonic() - started:.1f}s; "
          f"serving {url}", flush=True)
    config = uvicorn_config(app, settings)
    from bridges.log_safety import protect_server_logs

    protect_server_logs()  # after uvicorn set up its loggers: no forged lines, no signatures in logs
    launch.apply_to_logging()  # likewise after uvicorn set its loggers' levels
    DrainingServer(config, app, settings.shutdown_grace).run()
    return 0


def settle_startup_heap() -> int:
    """Collect start-up's garbage once, then freeze the rest (the model, tokenizer, libraries) out of the
    cyclic collector's sight, as vLLM does after loading: a full collection walked those ~350,000 objects
    in ~230 ms with the engine thread stopped (the GIL), a pause mid-stream whenever one came. Later
    collections walk only what serving creates. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def port_problem(host: str, port: int) -> str | None:
    """Why the server could not bind (port taken, address not local), or None. The socket is closed
    again at once; SO_REUSEADDR as uvicorn binds, so a port in TIME_WAIT still counts as free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("spark-server")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spark-server", description=__doc__)
    parser.add_argument("--version", action="version", version=f"spark-server {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the server",
                           description="Start the server. Each flag also reads from SPARK_<NAME> and the "
                                       "--config TOML file (flag > env > file > default).")
    settings_mod.add_arguments(serve)
    launch_compat.add_arguments(serve)  # `serve MODEL` and vLLM's / FastDeploy's flags
    serve.set_defaults(func=_serve)
    from lora_store.cli import add_commands

    add_commands(sub)
    sign = sub.add_parser("sign-url", help="print a Spark WebSocket URL signed with a key pair (--spark-auth)")
    sign.add_argument("--url", default="ws://127.0.0.1:9990/turing/v3/gpt")
    sign.add_argument("--key", required=True)
    sign.add_argument("--secret", required=True)
    sign.set_defaults(func=_sign_url)
    return parser


def _sign_url(args: argparse.Namespace) -> int:
    from spark_server.auth import sign_url

    print(sign_url(args.url, args.key, args.secret))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = args.func
    del args.func, args.command
    if hasattr(args, "lora_command"):
        del args.lora_command
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
