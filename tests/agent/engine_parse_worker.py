"""Parses engine command lines with the engine's own code, in the engine's own environment.

Run by tests/agent/test_engine_parsers.py with the Python of an engine's
virtualenv (``~/.cache/llmgw/engines/<engine>``, made by ``make engines``), never
llmgw's: it imports nothing of llmgw. One request per stdin line, one answer
per stdout line (JSON), so that the engine is imported once for a whole
property test:

    {"engine": "sglang" | "vllm" | "llama_cpp.server",
     "argv": [...the launch's argv, with the executable...],
     "env": {...the launch's added environment...},
     "files": {"PATH": "text"}}           # secret files the supervisor writes

    {"ok": true, "values": {...what the engine parsed...}}
    {"ok": false, "error": "...what the engine said..."}
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import traceback
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def environment(added: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value)


def _pick(source: Any, names: list[str]) -> dict[str, Any]:
    return {name: _plain(getattr(source, name, None)) for name in names}


def sglang(argv: list[str]) -> dict[str, Any]:
    """As ``sglang serve`` parses (cli/serve.py -> srt/server_args.prepare_server_args),
    then the hooks that refuse flags beside an API key (arg_groups/serving_hook.py)."""
    from sglang.srt.arg_groups import serving_hook
    from sglang.srt.server_args import prepare_server_args

    if argv[1:2] != ["serve"]:
        raise SystemExit(f"not an sglang serve command: {argv[:2]}")
    args = prepare_server_args(argv[2:])
    serving_hook.handle_deprecated_args(args)
    serving_hook.handle_ssl_validation(args)
    values = _pick(args, [
        "model_path", "served_model_name", "host", "port", "tp_size", "pp_size", "api_key",
        "admin_api_key", "nnodes", "node_rank", "dist_init_addr", "enable_metrics",
        "ssl_keyfile", "ssl_certfile", "enable_ssl_refresh", "grpc_port",
    ])  # fmt: skip
    # What SGLang logs in its start line (entrypoints/engine.py
    # _server_args_for_logging; that module needs the server's dependencies).
    from sglang.srt.sampling.watermarking.core import redact_watermark_secrets

    values["start_line"] = f"server_args={redact_watermark_secrets(args.resolved_dict())}"
    return values


def vllm(argv: list[str]) -> dict[str, Any]:
    """As ``vllm serve`` parses (entrypoints/cli/main.py with the serve subcommand's
    make_arg_parser, then its validate_parsed_serve_args), or
    ``python -m vllm.entrypoints.openai.api_server`` (launchers/api_server/entry.py:
    the same parser without the subcommand)."""
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
        validate_parsed_serve_args(args)
    else:
        import vllm.entrypoints.cli.serve as serve

        parser = FlexibleArgumentParser(prog="vllm")
        subparsers = parser.add_subparsers(required=False, dest="subparser")
        commands = {}
        for command in serve.cmd_init():
            command.subparser_init(subparsers).set_defaults(dispatch_function=command.cmd)
            commands[command.name] = command
        args = parser.parse_args(argv[1:])
        commands[args.subparser].validate(args)
    # What it serves: the positional of ``vllm serve`` or --model.
    args.weights = getattr(args, "model_tag", None) or args.model
    return _pick(args, [
        "weights", "served_model_name", "host", "port", "tensor_parallel_size",
        "pipeline_parallel_size", "api_key", "nnodes", "node_rank", "master_addr",
        "master_port", "headless", "ssl_keyfile", "ssl_certfile", "enable_ssl_refresh",
        "ssl_ca_certs", "ssl_cert_reqs", "uds",
    ])  # fmt: skip


def llama_cpp_server(argv: list[str]) -> dict[str, Any]:
    """As ``python -m llama_cpp.server`` parses (its __main__.py): argparse over the
    settings' fields, then pydantic-settings, which also reads the environment."""
    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.settings import ModelSettings, ServerSettings, Settings

    if argv[1:3] != ["-m", "llama_cpp.server"]:
        raise SystemExit(f"not a llama_cpp.server command: {argv[:3]}")
    parser = argparse.ArgumentParser()
    add_args_from_model(parser, Settings)
    args = parser.parse_args(argv[3:])
    server = parse_model_from_args(ServerSettings, args)
    model = parse_model_from_args(ModelSettings, args)
    values = _pick(server, ["host", "port", "api_key", "ssl_keyfile", "ssl_certfile",
                            "interrupt_requests"])  # fmt: skip
    values.update(_pick(model, [
        "model", "model_alias", "n_ctx", "chat_format", "hf_tokenizer_config_path",
        "logits_all", "cache", "cache_size", "embedding", "n_gpu_layers",
    ]))  # fmt: skip
    # As the server's model loader reads a hf-tokenizer-config file.
    if model.chat_format == "hf-tokenizer-config" and model.hf_tokenizer_config_path:
        from llama_cpp.llama_chat_format import hf_tokenizer_config_to_chat_formatter

        with open(model.hf_tokenizer_config_path) as handle:
            hf_tokenizer_config_to_chat_formatter(json.load(handle))
    return values


PARSERS = {"sglang": sglang, "vllm": vllm, "llama_cpp.server": llama_cpp_server}


def options(engine: str) -> list[list[Any]]:
    """Every option string of the engine's parser, how many values it takes, and the
    field it sets."""
    parser: argparse.ArgumentParser
    if engine == "sglang":
        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
    elif engine == "vllm":
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
    else:
        from llama_cpp.server.cli import add_args_from_model
        from llama_cpp.server.settings import Settings

        parser = argparse.ArgumentParser()
        add_args_from_model(parser, Settings)
    found = []
    for action in parser._actions:
        takes = 0 if action.nargs == 0 else 1
        found.extend(
            [option, takes, action.dest] for option in action.option_strings if option != "-h"
        )
    return found


def vllm_routes(tasks: list[str]) -> list[str]:
    """The paths vLLM's API server mounts for a model that supports ``tasks``
    (launchers/api_server/routers.py register_api_routers, with the serve
    command's default arguments)."""
    import vllm.entrypoints.cli.serve as serve
    from fastapi import FastAPI
    from vllm.entrypoints.launchers.api_server.routers import register_api_routers
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    for command in serve.cmd_init():
        command.subparser_init(subparsers)
    args = parser.parse_args(["serve", "/weights"])
    app = FastAPI()
    app.state.args = args
    register_api_routers(args, app, tuple(tasks), None)
    return sorted({route.path for route in app.routes if hasattr(route, "path")})


def answer(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("options"):
        return {"ok": True, "values": {"options": options(request["engine"])}}
    if "score" in request:  # vLLM's /v1/score request model (pooling/scoring/protocol.py)
        from pydantic import TypeAdapter, ValidationError
        from vllm.entrypoints.pooling.scoring.protocol import ScoreRequest

        try:
            TypeAdapter(ScoreRequest).validate_python(request["score"])
        except ValidationError as exc:
            return {"ok": False, "error": str(exc)[:500]}
        return {"ok": True, "values": {}}
    if "routes" in request:
        return {"ok": True, "values": {"routes": vllm_routes(request["routes"])}}
    for path, text in request.get("files", {}).items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
    said = io.StringIO()
    try:
        with environment(request.get("env", {})), contextlib.redirect_stdout(said), \
                contextlib.redirect_stderr(said):  # fmt: skip
            values = PARSERS[request["engine"]](request["argv"])
    except SystemExit as exc:  # argparse's way of refusing
        return {"ok": False, "error": f"exit {exc.code}: {said.getvalue()[-2000:]}"}
    except Exception as exc:
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return {"ok": False, "error": f"{error} {said.getvalue()[-1000:]}"}
    return {"ok": True, "values": values}


def main() -> None:
    # Imported once, before the first request, so that answers are quick.
    for name in sys.argv[1:]:
        {"sglang": lambda: __import__("sglang.srt.server_args"),
         "vllm": lambda: __import__("vllm.entrypoints.cli.serve"),
         "llama_cpp.server": lambda: __import__("llama_cpp.server.settings")}[name]()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(answer(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
