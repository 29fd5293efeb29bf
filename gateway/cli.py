"""The `sinkgate` command line (SPEC 6): the one place logging is configured and
the app is run (in this process, or in `--workers N` forked ones). Subcommands
other than `serve` and `check-config` live in their own modules, imported only
when used.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import os
import select
import shlex
import sys
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from gateway.admin.cli import add_parsers as add_admin_parsers  # argparse only: cheap
from gateway.config.keys import MAX_WORKERS
from gateway.config.model import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    Config,
    DestinationConfig,
    format_duration,
    format_size,
    load_config,
    redact_url,
)
from gateway.config.notices import config_warnings
from gateway.config.reader import is_loopback, shown_env
from gateway.errors import ConfigError, GatewayError
from gateway.supervisor import Slot, Supervisor, reserve
from gateway.telemetry import traces
from gateway.telemetry.logs import LEVELS, configure_logging
from leases.errors import LeaseError

if TYPE_CHECKING:
    from gateway.reload import Plan

PROG = "sinkgate"


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns the process exit status."""
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:
        # Ctrl-C where a command has no handler of its own (`demo`, imports at
        # start): one line, not a traceback; 130 as a shell reports SIGINT.
        print("\nsinkgate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket's, not the reader's: a failure to see
        # The reader went away (`sinkgate rejections --all --json | head -1`): no
        # traceback, and nothing more written. What is still buffered would fail
        # again when Python flushes stdout on exit, so it goes nowhere.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says so at once)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor, no poll()
        return False


def _main(argv: list[str]) -> int:
    if argv[:1] == ["chaos"]:
        # chaos defines its own flags (and --help): everything after the word is theirs.
        return _delegate("gateway.tools.chaos.run", "chaos", argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "check-config":
        return _check_config(args)
    if args.command == "demo":
        return _delegate("gateway.tools.demo", "demo", args)
    if args.command == "rejections":
        return _delegate("gateway.admin.cli.rejections", "rejections", args)
    if args.command == "keys":
        return _delegate("gateway.admin.cli.keys", "keys", args)
    if args.command == "init":
        return _delegate("gateway.config.starter", "init", args)
    if args.command == "upstream":
        return _delegate("gateway.tools.upstream", "upstream", args)
    parser.print_help(sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="A fencing-aware, idempotent sink gateway."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(commands)
    check = commands.add_parser("check-config", help="validate the config and print a summary")
    _add_config(check)
    check.add_argument(
        "--connect",
        action="store_true",
        help="also open the store and a connection to each destination's upstream",
    )
    commands.add_parser("demo", help="run the worked example of a stale and a duplicate write")
    init = commands.add_parser("init", help="write a commented config to start from")
    init.add_argument(
        "dir", nargs="?", default="config", metavar="DIR", help="where (default: ./config)"
    )
    add_admin_parsers(commands)  # rejections, keys
    _add_upstream(commands)
    # Listed for --help only: main() hands `chaos ...` over before parsing.
    commands.add_parser("chaos", help="the fault-injection run (see `sinkgate chaos --help`)")
    return parser


def _add_serve(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the gateway")
    _add_config(serve)
    serve.add_argument(
        "--log-level",
        choices=LEVELS,
        default=(os.environ.get("SINKGATE_LOG_LEVEL") or "info").lower(),  # empty: unset
        help="minimum level logged (default: $SINKGATE_LOG_LEVEL or info)",
    )
    serve.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="auto: JSON lines unless stderr is a terminal",
    )
    serve.add_argument(
        "--workers",
        metavar="N",
        type=_workers,
        help=f"gateway processes sharing both listeners (1..{MAX_WORKERS}; "
        "default: [server] workers, else 1)",
    )


def _add_upstream(commands: Any) -> None:
    upstream = commands.add_parser(
        "upstream", help="run a small recording upstream that answers and logs every write"
    )
    upstream.add_argument("--host", default="127.0.0.1", help="address (default: 127.0.0.1)")
    upstream.add_argument(
        "--port", type=_count(65535, low=0), default=9000, help="port (default: 9000)"
    )
    upstream.add_argument(
        "--status",
        type=_count(599, low=200),
        default=201,
        help="the status every write is answered with (default: 201)",
    )


def _add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="gateway config (default: $SINKGATE_CONFIG or config/gateway.toml)",
    )


def _count(high: int, low: int = 1) -> Callable[[str], int]:
    """An argparse type: a whole number in `low`..`high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}..{high}, got {value}")
        return value

    return parse


_workers = _count(MAX_WORKERS)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PROG)
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def _error(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr)


def _load(args: argparse.Namespace) -> Config | None:
    """The config, or None after printing every error, paths as the user gave them."""
    given = args.config or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH
    try:
        return load_config(given, display=given)
    except ConfigError as exc:
        for line in exc.errors:
            _error(line)
        if not os.path.exists(given):
            if args.config or os.environ.get(CONFIG_ENV):
                _error(f"no config file: {_init_for(given)}")
            else:
                _error("no config file: run `sinkgate init` to write one, or pass --config PATH")
        return None


def _init_for(config: str) -> str:
    """How to write `config`: `sinkgate init DIR` writes DIR/gateway.toml."""
    path = Path(config)
    if path.name != "gateway.toml":
        return "run `sinkgate init` to write one (config/gateway.toml), then pass that"
    return f"run `sinkgate init {shlex.quote(str(path.parent))}` to write one"


def _serve(args: argparse.Namespace) -> int:
    if args.log_level not in LEVELS:  # argparse checks --log-level, not its default
        _error(f"SINKGATE_LOG_LEVEL must be one of {', '.join(LEVELS)}, not {args.log_level!r}")
        return 2
    config = _load(args)
    if config is None:
        return 1
    json = {"auto": None, "json": True, "console": False}[args.log_format]
    configure_logging(args.log_level, json=json)
    log = structlog.get_logger("gateway.cli")
    log.info("config_loaded", config=str(config.source), destinations=sorted(config.destinations))
    for warning in config_warnings(config) + open_access_warnings(config):
        log.warning("config_warning", warning=warning)
    # `--workers` overrides the file for everything that reads the count.
    if args.workers:
        config = dataclasses.replace(
            config, workers=args.workers, overridden=frozenset({"workers"})
        )
    workers = config.workers
    if workers == 1:
        return _run_gateway(config)
    try:
        _app().refuse_open_admin(config)
        listen = reserve(*config.listen, "[server] listen")
        admin_listen = reserve(*config.admin_listen, "[server] admin_listen")
    except OSError as exc:  # address in use, or not one of this host's
        _error(str(exc))
        return 1
    from gateway.telemetry.metrics import (
        METRICS_DIR_PREFIX,
        claim_metrics_directory,
        forget_process,
        sweep_metrics_directories,
    )

    # The workers' metrics, summed by whichever worker is scraped; removed at exit.
    # In memory where the system has a tmpfs for it: every metric update writes to
    # these files, and on a disk the kernel would write those pages back.
    in_memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    for gone in sweep_metrics_directories(in_memory):  # of a parent killed with -9
        structlog.get_logger("gateway.cli").info("metrics_directory_removed", path=gone)
    metrics_files = tempfile.TemporaryDirectory(prefix=METRICS_DIR_PREFIX, dir=in_memory)
    claim_metrics_directory(metrics_files.name)
    applied = _Applied(config)
    with listen, admin_listen, metrics_files as shared:
        supervisor = Supervisor(
            workers,
            listen.getsockname()[:2],
            admin_listen.getsockname()[:2],
            lambda slot: _run_gateway(
                applied.config,
                slot,
                metrics_directory=shared,
                record=applied.unrecorded if slot.record_reload_at_start else None,
            ),
            exited=lambda pid: forget_process(pid, shared),
            reread=applied.reread,
        )
        return supervisor.main()


class _Applied:
    """The parent's copy of the config the workers serve, brought up to date at
    each reload they are told of, as they do it (`plan_reload`): a worker started
    again is forked with it. Not the files as they are when it starts: a reload
    that failed, or an edit nobody reloaded, would have it serve what the others
    do not (another upstream, shorter retention)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.unrecorded: Plan | None = None  # a SIGHUP no worker took, for the next to record
        self._unrecorded_from = config

    def reread(self, alone: bool, earlier: bool) -> None:
        from gateway.reload import plan_reload  # imported by the app already

        if alone and not earlier:  # a new run of SIGHUPs nobody took: nothing of it yet
            self._unrecorded_from, self.unrecorded = self.config, None
        base = self._unrecorded_from if alone else self.config
        try:
            plan = plan_reload(base)
        except ConfigError as exc:
            if alone:  # no worker says it
                for line in exc.errors:
                    structlog.get_logger("gateway.reload").error(
                        "reload_failed", trigger="sighup", error=line
                    )
            return  # the workers keep what they serve, and so does this copy
        if alone:  # one row for every change since the last one recorded
            self._unrecorded_from, self.unrecorded = base, plan
        self.config = plan.config


def _run_gateway(
    config: Config,
    slot: Slot | None = None,
    *,
    metrics_directory: str | None = None,
    record: Plan | None = None,
) -> int:
    """`serve` in this process (or in worker `slot`, its metrics shared with the
    other workers' in `metrics_directory`); its exit status."""
    traces.configure_from_env()  # off unless OTEL_TRACES_EXPORTER names an exporter
    if metrics_directory is not None:
        from gateway.telemetry.metrics import share_between_processes

        share_between_processes(metrics_directory)
    app = _app()
    main = (
        app.serve(config)
        if slot is None
        else app.serve(config, started=slot.ready, slot=slot, record=record)
    )
    try:
        _run(main)
    except KeyboardInterrupt:
        # The app stops gracefully on SIGINT itself; this is an interrupt
        # before its handlers were in place, which SPEC 6 also answers with 0.
        return 0
    except LeaseError as exc:
        # The store could not be opened (unreachable, refused, unusable file).
        from gateway.store.probe import known_trouble_in

        why = known_trouble_in(config.store_url, exc) or exc
        _error(f"store {redact_url(config.store_url)}: {why}")
        return 1
    except (GatewayError, OSError) as exc:
        # Other start-up failures (address in use, a refusal by the app): one
        # line, not a traceback.
        _error(str(exc))
        return 1
    finally:
        traces.shutdown()  # the spans of the last writes reach the exporter
    return 0


def _app() -> Any:
    """`gateway.app`, looked up when `serve` runs (as `_delegate` looks up the other
    subcommands): the app and what it needs load only for `serve`, and a test can
    stand in for the module."""
    return importlib.import_module("gateway.app")


def _run(main: Coroutine[Any, Any, None]) -> None:
    factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def _check_config(args: argparse.Namespace) -> int:
    config = _load(args)
    if config is None:
        return 1
    for warning in config_warnings(config):
        _error(f"warning: {warning}")
    print(summary(config))
    if not args.connect:
        return 0
    failed = asyncio.run(_connect(config))
    return 1 if failed else 0


async def _connect(config: Config) -> int:
    """`check-config --connect`: the store and each upstream, one line each (on
    stdout when it works, on stderr saying what to check when not); how many
    failed."""
    from gateway.store.probe import ProbeFailed, store_status
    from gateway.write.probe import UpstreamUnreachable, upstream_status

    failed = 0
    store = _store_shown(config.store_url)
    try:
        print(f"connect       store {store}: {await store_status(config.store_url)}")
    except ProbeFailed as exc:
        _error(f"store {store}: {exc}")
        failed += 1
    width = max((len(name) for name in config.destinations), default=0)
    results = await asyncio.gather(
        *(upstream_status(dest) for dest in config.destinations.values()),
        return_exceptions=True,
    )
    for (name, dest), result in sorted(zip(config.destinations.items(), results, strict=True)):
        if isinstance(result, UpstreamUnreachable):
            _error(f"destination {name}: upstream {dest.upstream}: {result}")
            failed += 1
        elif isinstance(result, BaseException):
            raise result
        else:
            print(f"  {name:<{width}}  {dest.upstream}: {result}")
    return failed


def open_access_warnings(config: Config) -> list[str]:
    """What `serve` lets in without a token, said once at start (check-config's
    summary says it on its own lines)."""
    found = []
    if config.admin_token is None and not config.admin_operators:
        found.append(
            f"the admin listener has no token ({shown_env(config.admin_token_env, dollar=True)} "
            "is not set): any "
            "user or process on this machine can reload, resolve keys and read the logs"
        )
    admin_host = config.admin_listen[0]
    if config.tls_cert is None and not is_loopback(admin_host):
        found.append(
            f"the admin listener on {admin_host} serves plain HTTP beyond loopback: its "
            "tokens and session cookies cross the network in clear (set tls_cert and "
            "tls_key, or reach it through a TLS proxy on this machine)"
        )
    host = config.listen[0]
    if is_loopback(host):
        return found
    if not config.lease_tokens:
        found.append(
            f"the lease API is open to whoever reaches {host}: set [server] lease_tokens_env"
        )
    open_destinations = [name for name, d in config.destinations.items() if not d.worker_tokens]
    if open_destinations:
        found.append(
            f"destinations {', '.join(sorted(open_destinations))} take writes from whoever "
            f"reaches {host}: set worker_tokens_env in their files"
        )
    return found


def _admin_access(config: Config) -> list[str]:
    """Who /admin lets in: the shared token's variable, and the operators by name
    (their tokens are never shown)."""
    shared = "set" if config.admin_token else "not set"
    token = f"admin token   {shared} ({shown_env(config.admin_token_env, dollar=True)})"
    if not config.admin_operators:
        return [token]
    names = ", ".join(sorted(name for name, _ in config.admin_operators))
    return [token, f"operators     {names} (a token of their own each, named in the audit log)"]


def _lease_api_access(config: Config) -> str:
    if config.lease_tokens:
        return f"needs one of {len(config.lease_tokens)} bearer token(s)"
    return "open to whoever reaches the listener (no [server] lease_tokens_env)"


def _store_shown(url: str) -> str:
    """A SQLite store as its file (relative to here when it is below), else the URL
    without its password."""
    if not url.startswith("sqlite:///") or url.endswith(":memory:"):
        return redact_url(url)
    path = url[len("sqlite:///") :]
    relative = os.path.relpath(path)
    return f"SQLite file {path if relative.startswith('..') else relative}"


def _listener_tls(config: Config) -> str:
    if config.tls_cert is None:
        return "off: both listeners serve plain HTTP"
    return f"both listeners serve HTTPS only ({config.tls_cert})"


def _upstream_tls(dest: DestinationConfig) -> str:
    if not dest.upstream.startswith("https://"):
        return ""
    trust = "ca_file" if dest.ca_file else "system CAs"
    if not dest.tls_verify:
        trust = "not verified"
    return f"  tls={trust}{',client_cert' if dest.client_cert else ''}"


def _pool_shown(config: Config) -> str:
    """`pool_size` where it applies: PostgreSQL's connections (SQLite has one)."""
    return "" if config.store_url.startswith("sqlite") else f" (pool size {config.store_pool_size})"


def summary(config: Config) -> str:
    """A readable account of `config`; names secrets' variables, never their values."""

    def addr(host_port: tuple[str, int]) -> str:
        host, port = host_port
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    lines = [
        f"config        {config.display or config.source}: OK",
        f"listen        {addr(config.listen)}",
        f"admin listen  {addr(config.admin_listen)}",
        f"tls           {_listener_tls(config)}",
        f"store         {_store_shown(config.store_url)}{_pool_shown(config)}",
        *_admin_access(config),
        f"lease API     {_lease_api_access(config)}",
        f"retention     idempotency keys {format_duration(config.idempotency_ttl)}, "
        f"rejections {format_duration(config.rejections_ttl)}, "
        f"audit log {format_duration(config.audit_ttl)}",
        f"limits        {config.max_in_flight} writes in flight, "
        f"{config.max_waiting} waiting under Prefer: wait per process, "
        f"shutdown grace {format_duration(config.shutdown_grace)}",
    ]
    if config.workers > 1:  # one process: the summary as it always was
        lines.append(f"workers       {config.workers} processes sharing both listeners")
    if not config.destinations:
        lines.append("destinations  none: every write will be refused as unknown_destination")
        return "\n".join(lines)
    lines.append(f"destinations  {len(config.destinations)}")
    width = max(len(name) for name in config.destinations)
    for name, dest in sorted(config.destinations.items()):
        headers = ",".join(dest.upstream_header_names) or "none"
        lines.append(
            f"  {name:<{width}}  {dest.upstream}  fencing={dest.fencing.value}"
            f"  methods={','.join(sorted(dest.methods))}"
            f"  timeout={format_duration(dest.timeout)}"
            f"  connect_timeout={format_duration(dest.connect_timeout)}"
            # whole seconds, as `Preference-Applied` says it ("1500ms" waits 1 s)
            f"  max_wait={int(dest.max_wait)}s"
            f"  max_body={format_size(dest.max_body)}"
            f"  idempotency_key={'required' if dest.require_idempotency_key else 'optional'}"
            f"  auth={'yes' if dest.worker_tokens else 'no'}"
            f"  upstream_headers={headers}" + _upstream_tls(dest)
        )
    return "\n".join(lines)


def _delegate(module_name: str, command: str, args: Any) -> int:
    """Run `module_name.main(args)`, a subcommand that lives in its own module."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # the module exists but one of its imports is missing
        _error(f"the {command} command is not available in this installation ({module_name})")
        return 2
    result = module.main(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
