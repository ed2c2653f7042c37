"""The `kiln` command: the local stack, its parts, and the admin tools."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .admin import BROKEN_PIPE, add_admin_parser, run_admin
from .argtypes import bounded_int, http_url, non_negative

__all__ = ["main"]


_port = bounded_int("a port number", 0, 65535)  # 0: one the system picks, printed as bound
_PORT_HELP = "0: any free port, the one taken printed"
_FD_HELP = ("serve on this inherited listening socket instead of binding --host and --port "
            "(kiln dev hands its parts theirs)")

_fd = bounded_int("a file descriptor", 3, 2**31 - 1)

FAULTS_HELP = (
    "DynamoDB under contention, e.g. conflict=0.5,throttle=0.05,lost=0.05,txn_ms=5,seed=7,scope=gateway: "
    "conflict = rate at which a write to an item that transactions write meets another transaction "
    "(TransactionConflictException, or a cancellation with reason TransactionConflict); throttle = rate of "
    "ProvisionedThroughputExceededException; lost = rate of writes applied whose answer is cut off; txn_ms = how "
    "long a transaction holds its items (writes meeting them conflict); index_ms = how long a write takes to reach "
    "the global secondary indexes (a Query of one leaves out items written since); ssm_tps = the most SSM "
    "GetParameter calls answered in a second, ThrottlingException beyond (Parameter Store: 40); seed = the draws' "
    "seed; scope = all calls "
    "or only the gateway's (not operators' tools: botocore's calls and kiln admin's). Default: the KILN_EMULATOR_FAULTS environment "
    "variable, else off"
)


def _faults(text: str):
    from .emulator import Faults

    try:
        return Faults.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    """argparse, but a value of `--` (`--label=--`, or `-- --` for an amount) is a usage error:
    Python's argparse drops the `--` and hands the option's type an empty list."""

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        if arg_strings == ["--"] and action.nargs in (None, argparse.OPTIONAL):
            self.error(f"argument {'/'.join(action.option_strings) or action.dest}: '--' is not a value")
        return super()._get_values(action, arg_strings)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kiln", description="Kiln gateway: local stack and operator tools.")
    commands = parser.add_subparsers(dest="command", required=True)

    dev = commands.add_parser("dev", help="run the whole stack locally (gateway + embedded AWS + mock model server)")
    dev.add_argument("--host", default="127.0.0.1", help="address to serve the gateway on (default 127.0.0.1)")
    dev.add_argument("--port", type=_port, default=8000, help=f"gateway port (default 8000; {_PORT_HELP})")
    dev.add_argument("--upstream-url", type=http_url, help="serve every model from this OpenAI-compatible server (…/v1) instead of the mock")
    dev.add_argument("--mock-token-delay-ms", type=non_negative, default=20.0, help="the mock's delay between tokens (default 20)")
    dev.add_argument("--aws-endpoint-url", type=http_url, help="use this DynamoDB/SSM endpoint instead of starting the embedded AWS")
    dev.add_argument("--faults", type=_faults, help="the embedded AWS's fault mode: " + FAULTS_HELP)

    mock = commands.add_parser("mock-upstream", help="an OpenAI-compatible model server with fault injection")
    mock.add_argument("--host", default="127.0.0.1")
    mock.add_argument("--port", type=_port, default=8001, help=f"default 8001; {_PORT_HELP}")
    mock.add_argument("--fd", type=_fd, help=_FD_HELP)
    mock.add_argument("--token-delay-ms", type=non_negative, default=0.0, help="delay between tokens")
    mock.add_argument("--ttft-ms", type=non_negative, default=0.0, help="delay before the first token")

    emulator = commands.add_parser("emulator", help="the embedded AWS alone (serialized moto: DynamoDB, SSM)")
    emulator.add_argument("--host", default="127.0.0.1")
    emulator.add_argument("--port", type=_port, default=4566, help=f"default 4566; {_PORT_HELP}")
    emulator.add_argument("--fd", type=_fd, help=_FD_HELP)
    emulator.add_argument("--faults", type=_faults, help=FAULTS_HELP)

    e2e = commands.add_parser(
        "e2e-real", help="run tests/e2e_real against a real model server (llama.cpp, Gemma 3 270M) behind the stack"
    )
    e2e.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed on to pytest")

    verify = commands.add_parser("verify-build", help="check a sam build: aarch64 binaries, python3.13 pycs")
    verify.add_argument("build_dir", nargs="?", default=".aws-sam/build")

    add_admin_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "admin":
        code = run_admin(args)
        try:
            sys.stdout.flush()  # what a pipe's reader gets is written here, not at exit
        except BrokenPipeError:
            code = BROKEN_PIPE
        if code == BROKEN_PIPE:
            _stdout_to_nowhere()  # what is left in its buffer would fail again at exit
        return code
    if args.command == "dev":
        from .dev import run_dev

        return run_dev(
            host=args.host,
            port=args.port,
            upstream_url=args.upstream_url,
            mock_token_delay_ms=args.mock_token_delay_ms,
            aws_endpoint_url=args.aws_endpoint_url,
            faults=args.faults,
        )
    if args.command == "e2e-real":
        from .e2e_real import run_e2e_real

        return run_e2e_real(args.pytest_args)
    if args.command == "verify-build":
        from .build_check import main as verify_build

        return verify_build(args.build_dir)
    if args.command == "mock-upstream":
        from .mock_upstream import MockUpstream
        from .serve import listen_as, serve, served_url

        sock = listen_as("kiln mock-upstream", args.host, args.port, args.fd)
        print(f"kiln mock-upstream: serving on {served_url(sock)}/v1", flush=True)
        serve(MockUpstream(token_delay_ms=args.token_delay_ms, ttft_ms=args.ttft_ms), sock)
        return 0
    if args.command == "emulator":
        from .emulator import Faults, serialized_app
        from .serve import listen_as, serve, served_url

        try:
            faults = args.faults or Faults.from_env()
        except ValueError as exc:
            print(f"kiln emulator: KILN_EMULATOR_FAULTS: {exc}", file=sys.stderr)
            return 2
        sock = listen_as("kiln emulator", args.host, args.port, args.fd)
        print(f"kiln emulator: embedded AWS on {served_url(sock)} (faults: {faults.describe()})", flush=True)
        serve(serialized_app(faults), sock)
        return 0
    raise AssertionError(args.command)


def _stdout_to_nowhere() -> None:
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
