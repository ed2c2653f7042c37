"""`kiln admin`: orgs, keys, credits, usage, generations, the catalog and maintenance.

It reaches the same state as the gateway through the same settings: a shell that
evaluated `kiln dev`'s exports talks to the local stack; `--stack NAME` reads a deployed
stack's outputs (with the usual AWS configuration for region and credentials).
Tables are for people; `--format json|csv` is for scripts. Any error: exit 1 and one line
on stderr (argument errors: exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Callable

from kiln.jsonio import decimal_text
from kiln.shown import escaped
from kiln.store.orgs import MAX_CONCURRENCY

from .argtypes import bounded_int, usd
from .backends import add_backends_parser
from .output import FORMATS, render
from .reports import GROUPINGS, in_span, parse_time, summarize

__all__ = ["AdminError", "add_admin_parser", "run_admin"]


class AdminError(Exception):
    """A one-line reason for a non-zero exit."""


@dataclass
class Context:
    settings: Any
    _tables: Any = None
    _ssm: Any = None

    @property
    def tables(self) -> Any:
        if self._tables is None:
            from kiln.store import bind

            self._tables = bind(self.settings)
        return self._tables

    @property
    def ssm(self) -> Any:
        if self._ssm is None:
            from .provision import aws_clients

            self._ssm = aws_clients(self.settings)[1]
        return self._ssm


_positive = bounded_int("a whole number", 1)
_org_limit = bounded_int("a concurrency limit", 1, MAX_CONCURRENCY)


def _time(text: str) -> str:
    try:
        return parse_time(text)
    except (ValueError, OverflowError):  # OverflowError: a time with no date in UTC (years 1-9999)
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date or time of the years 1 to 9999 in UTC: {text!r}") from None


def _until(text: str) -> datetime:
    from kiln.maintenance import parse_until

    try:
        return parse_until(text)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time with a date in UTC: {text!r}") from None


def add_admin_parser(subparsers: Any) -> None:
    admin = subparsers.add_parser("admin", help="manage orgs, keys, credits, usage, the catalog and maintenance")
    admin.add_argument("--stack", help="a deployed stack's name: its outputs name the tables and parameters")
    groups = admin.add_subparsers(
        dest="group", required=True,
        metavar="{orgs,keys,credits,usage,generation,replay-usage,catalog,backends,upstream-key,maintenance}"
    )
    formatted = argparse.ArgumentParser(add_help=False)
    formatted.add_argument("--format", choices=FORMATS, default="table", help="table (default), json or csv")

    orgs = groups.add_parser("orgs", help="organisations").add_subparsers(dest="action", required=True)
    create = orgs.add_parser("create", help="create an org")
    create.add_argument("org")
    create.add_argument("--concurrency", type=_org_limit, default=None,
                        help=f"requests in flight at most, 1-{MAX_CONCURRENCY} (default 8)")
    create.add_argument("--credits", type=usd, default=Decimal(0), help="initial prepaid credits, USD (default 0)")
    create.set_defaults(run=_orgs_create, writes=True)
    orgs.add_parser("list", help="every org", parents=[formatted]).set_defaults(run=_orgs_list)
    show = orgs.add_parser("show", help="an org's status, limit, credits and requests in flight", parents=[formatted])
    show.add_argument("org")
    show.set_defaults(run=_orgs_show)
    for name, status in (("disable", "disabled"), ("enable", "active")):
        toggle = orgs.add_parser(name, help=f"{name} an org")
        toggle.add_argument("org")
        toggle.set_defaults(run=lambda ctx, args, out, status=status: _orgs_status(ctx, args, out, status),
                            writes=True)
    limit = orgs.add_parser("set-limit", help="change an org's concurrency limit")
    limit.add_argument("org")
    limit.add_argument("concurrency", type=_org_limit, help=f"1-{MAX_CONCURRENCY}")
    limit.set_defaults(run=_orgs_set_limit, writes=True)

    keys = groups.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    key_create = keys.add_parser("create", help="issue a key (the secret is printed once)")
    key_create.add_argument("org")
    _key_attribute_flags(key_create, "")
    key_create.set_defaults(run=_keys_create, writes=True)
    key_update = keys.add_parser(
        "update", help="change a key's label, role or limits (within the gateway's auth cache time)"
    )
    key_update.add_argument("key_id")
    _key_attribute_flags(key_update, "; none: back to the default")
    key_update.set_defaults(run=_keys_update, writes=True)
    revoke = keys.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    revoke.set_defaults(run=_keys_revoke, writes=True)
    key_list = keys.add_parser(
        "list", help="an org's keys: ids, prefixes, labels, roles, limits and this period's spend (never secrets)",
        parents=[formatted],
    )
    key_list.add_argument("org")
    key_list.set_defaults(run=_keys_list)
    key_tally = keys.add_parser(
        "tally", help="add the usage events of a version that kept no tallies to their keys' tallies "
                      "(once every function runs this version)")
    key_tally.add_argument("org", nargs="*", help="these orgs (default: every org)")
    key_tally.add_argument(
        "--progress", action="store_true", help="report progress on stderr even when it is not a terminal"
    )
    key_tally.set_defaults(run=_keys_tally, writes=True)
    key_recount = keys.add_parser(
        "recount", help="set each org's count of keys with a spend limit from its keys (after functions of a "
                        "version that kept no count changed limits: a rollback)")
    key_recount.add_argument("org", nargs="*", help="these orgs (default: every org)")
    key_recount.set_defaults(run=_keys_recount, writes=True)

    credits = groups.add_parser("credits", help="prepaid credits").add_subparsers(dest="action", required=True)
    add = credits.add_parser("add", help="add USD to an org's credits (negative to correct)")
    add.add_argument("org")
    add.add_argument("usd", type=usd)
    add.set_defaults(run=_credits_add, writes=True)
    balance = credits.add_parser("show", help="an org's balance and its latest debits", parents=[formatted])
    balance.add_argument("org")
    balance.add_argument("--last", type=_positive, default=10, help="how many debits (default 10)")
    balance.set_defaults(run=_credits_show)

    usage = groups.add_parser("usage", help="an org's requests, tokens, cost and errors", parents=[formatted])
    usage.add_argument("org")
    usage.add_argument("--since", type=_time, help="from this ISO 8601 date or time (UTC), inclusive")
    usage.add_argument("--until", type=_time, help="to this ISO 8601 date or time (UTC), exclusive")
    usage.add_argument("--by", choices=sorted(GROUPINGS), default="model", help="one row per model (default), day, key or endpoint")
    usage.add_argument(
        "--progress", action="store_true", help="report progress on stderr even when it is not a terminal"
    )
    usage.set_defaults(run=_usage)

    generation = groups.add_parser("generation", help="one usage event, by generation id", parents=[formatted])
    generation.add_argument("gen_id")
    generation.set_defaults(run=_generation)

    replay = groups.add_parser(
        "replay-usage", help="settle the usage events the gateway logged as usage_unsettled (storage was down)"
    )
    replay.add_argument("file", nargs="?", default="-", help="exported log lines (default: standard input)")
    replay.add_argument(
        "--progress", action="store_true", help="report progress on stderr even when it is not a terminal"
    )
    replay.set_defaults(run=_replay_usage, writes=True,
                        on_interrupt="the events it settled stand; replaying the same lines again settles the "
                                     "others and changes nothing else")

    catalog = groups.add_parser("catalog", help="the model catalog (SSM parameter)").add_subparsers(
        dest="action", required=True
    )
    put = catalog.add_parser("set", help="validate a catalog file and make it the stack's catalog")
    put.add_argument("file", help="a JSON catalog, in the format of infra/catalog.json")
    put.set_defaults(run=_catalog_set, writes=True)
    seed = catalog.add_parser("seed", help="create the catalog if there is none yet (first deploy); never overwrites")
    seed.add_argument("file", nargs="?", help="a JSON catalog (default: infra/catalog.json)")
    seed.set_defaults(run=_catalog_seed, writes=True)
    show = catalog.add_parser("show", help="print the stack's catalog (JSON, as stored), or --summary")
    show.add_argument("--summary", action="store_true", help="one line per model: prices, backends")
    show.set_defaults(run=_catalog_show)

    add_backends_parser(groups, formatted)

    upstream_key = groups.add_parser(
        "upstream-key", help="the model servers' bearer token (SSM SecureString)"
    ).add_subparsers(dest="action", required=True)
    key_set = upstream_key.add_parser("set", help="store a new key, read from standard input (rotation: no deploy)")
    key_set.add_argument("--kms-key-id", help="a customer managed KMS key (default: the AWS managed aws/ssm)")
    key_set.set_defaults(run=_upstream_key_set, writes=True)
    upstream_key.add_parser("status", help="whether a key is stored, its version and date (never the key)").set_defaults(
        run=_upstream_key_status
    )

    maintenance = groups.add_parser("maintenance", help="the maintenance switch").add_subparsers(
        dest="action", required=True
    )
    on = maintenance.add_parser("on", help="answer 503 maintenance on every endpoint")
    on.add_argument("--until", type=_until,
                    help="ISO 8601 end time (a time without a zone is UTC), sent as Retry-After")
    on.add_argument("--message", help="the message clients see")
    on.set_defaults(run=_maintenance_on, writes=True)
    maintenance.add_parser("off", help="serve again").set_defaults(run=_maintenance_off, writes=True)
    maintenance.add_parser("status", help="show the switch").set_defaults(run=_maintenance_status)


# `none` as a flag's value clears the attribute (keys update), for every attribute flag
NONE = "none"


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def value(text: str) -> Any:
        return NONE if text == NONE else parse(text)

    return value


def _models_flag(text: str) -> list[str]:
    models = [model.strip() for model in text.split(",") if model.strip()]
    if not models:
        raise argparse.ArgumentTypeError("name at least one model id (comma-separated), or none")
    return models


def _choice(*choices: str) -> Callable[[str], str]:
    def value(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"one of {', '.join(choices)} (or none), got {text!r}")
        return text

    return value


def _key_attribute_flags(parser: argparse.ArgumentParser, clears: str) -> None:
    """The key attributes of contract §10, as flags; left out: unchanged (update) or the default."""
    parser.add_argument("--label", type=_or_none(str), help=f"a name for people, up to 100 characters, no control or invisible ones, no blank at either end{clears}")
    parser.add_argument("--role", type=_or_none(_choice("inference", "management")),
                        help=f"inference (default: calls models) or management (manages the org's keys){clears}")
    parser.add_argument("--models", type=_or_none(_models_flag),
                        help=f"comma-separated catalog ids the key may call (default: every model){clears}")
    parser.add_argument("--concurrency", type=_or_none(_positive),
                        help=f"its own limit of requests in flight, at most the org's (default: the org's){clears}")
    parser.add_argument("--spend-limit", type=_or_none(usd), dest="spend_limit",
                        help=f"USD the key may spend per --spend-period (default: no limit){clears}")
    parser.add_argument("--spend-period", type=_or_none(_choice("day", "week", "month", "total")),
                        dest="spend_period", help=f"day, week, month (UTC) or total (default){clears}")


KEY_FLAGS = ("label", "role", "models", "concurrency", "spend_limit", "spend_period")


# the status of a command whose output's reader left (128 + SIGPIPE), as a shell reports it
BROKEN_PIPE = 141
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def run_admin(args: argparse.Namespace, settings: Any = None, out: Callable[[str], None] = print) -> int:
    from kiln.settings import Settings, SettingsError

    from .stack import StackNotFound, settings_from_stack

    try:
        settings = settings or Settings.from_env()
        if getattr(args, "stack", None):
            settings = settings_from_stack(args.stack, settings)
        args.run(Context(settings), args, out)
        return 0
    except BrokenPipeError:  # its reader left (`| head`): stop there, as a Unix command does
        return BROKEN_PIPE
    except KeyboardInterrupt:  # Ctrl-C: one line, what stands, never a traceback
        said = getattr(args, "on_interrupt", None) or (
            "what it changed before it stopped stands: look (show or list) before making it again"
            if getattr(args, "writes", False) else "it changed nothing")
        print(f"kiln admin: interrupted; {said}", file=sys.stderr)
        return INTERRUPTED
    except (AdminError, SettingsError, StackNotFound, ValueError) as exc:
        print(f"kiln admin: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        print(f"kiln admin: {_describe(exc, writes=getattr(args, 'writes', False))}", file=sys.stderr)
        return 1


def _describe(exc: BaseException, *, writes: bool = False) -> str:
    """One line for a failure; for a command that `writes`, whether its change may have been
    made though the command failed (an answer lost, or AWS unreachable after a try that
    reached it: the AWS clients say only how their last try failed)."""
    from kiln.store.errors import StorageError, is_transient, may_have_been_applied, translate_storage_error

    told = _said(exc)
    failure = exc if isinstance(exc, StorageError) else translate_storage_error(exc)
    if writes and may_have_been_applied(failure):
        return f"{told}: the answer was lost, and the change may have been made. Look (show or list) before making it again."
    if writes and is_transient(failure):
        return f"{told} (if an earlier try reached AWS, the change may have been made: look before making it again)"
    return told


def _said(exc: BaseException) -> str:
    from kiln.store import AlreadyRevoked, RecordExists, RecordNotFound
    from kiln.store.errors import may_have_been_applied, translate_storage_error

    if isinstance(exc, (AlreadyRevoked, RecordExists, RecordNotFound)):
        return str(exc)
    from kiln.aws import AwsError

    for cause in _causes(exc):  # the lean client's (key management)
        if isinstance(cause, AwsError) and cause.code == "NoCredentials":
            return "no AWS credentials: configure them (or evaluate kiln dev's exports)"
        if isinstance(cause, AwsError) and cause.code == "ConnectionError":
            if may_have_been_applied(translate_storage_error(cause)):  # sent: the answer never came
                return f"no answer from AWS ({cause.message})"
            return f"cannot reach AWS: Could not connect to the endpoint URL ({cause.message})"
    for cause in _causes(exc):  # pynamodb wraps botocore's errors
        name = type(cause).__name__
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            return "no AWS credentials: configure them (or evaluate kiln dev's exports)"
        if name in ("EndpointConnectionError", "ConnectionRefusedError", "ConnectTimeoutError"):
            return f"cannot reach AWS: {cause}"
    translated = str(translate_storage_error(exc))
    for cause in _causes(exc):  # a refusal says why: DynamoDB's message, as botocore has it
        message = (getattr(cause, "response", None) or {}).get("Error", {}).get("Message")
        if isinstance(message, str) and message and message not in translated:
            return f"{translated}: {message[:300]}"
    return translated


def _causes(exc: BaseException | None):
    seen = 0
    while exc is not None and seen < 6:
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__ or exc.__context__
        seen += 1


# -- commands ---------------------------------------------------------------------------------


def _orgs_create(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import create_org

    concurrency = args.concurrency or ctx.settings.default_concurrency
    org = create_org(ctx.tables, args.org, concurrency=concurrency, credits=args.credits)
    out(f"created org {org.org_id}: concurrency {org.concurrency_limit}, credits ${decimal_text(org.credits)}")


ORG_COLUMNS = ("org_id", "status", "concurrency_limit", "credits", "in_flight", "created_at")


def _org_row(org) -> dict[str, Any]:
    return {column: getattr(org, column) for column in ORG_COLUMNS}


def _orgs_list(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import list_orgs

    render([_org_row(org) for org in list_orgs(ctx.tables)], ORG_COLUMNS, args.format, out)


def _orgs_show(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import get_org

    org = get_org(ctx.tables, args.org)
    if args.format != "table":
        return render([_org_row(org)], ORG_COLUMNS, args.format, out)
    out(f"org {org.org_id}")
    out(f"  status       {org.status}")
    out(f"  concurrency  {org.concurrency_limit}")
    out(f"  credits      ${decimal_text(org.credits)}")
    out(f"  in flight    {org.in_flight}")
    out(f"  created      {org.created_at}")


def _orgs_status(ctx: Context, args: argparse.Namespace, out, status: str) -> None:
    from kiln.store.orgs import set_status

    set_status(ctx.tables, args.org, status)
    out(f"org {args.org} is now {status}")


def _orgs_set_limit(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import set_limit

    set_limit(ctx.tables, args.org, args.concurrency)
    out(f"org {args.org}: concurrency limit {args.concurrency}")


def _known_models(ctx: Context, attributes: dict[str, Any]) -> set[str] | None:
    """The catalog's ids, to check --models against (read only when it is given)."""
    from kiln.catalog import Catalog

    if not isinstance(attributes.get("models"), list):
        return None
    if ctx.settings.catalog_file:
        raw = open(ctx.settings.catalog_file, encoding="utf-8").read()
    else:
        raw = _stored_catalog(ctx)
    if raw is None:
        raise AdminError(f"no catalog parameter {ctx.settings.catalog_parameter} to check --models against: "
                         "create it with catalog seed")
    return {model.id for model in (Catalog.from_json(raw) if ctx.settings.catalog_file
                                   else _stored_catalog_parsed(ctx, raw))}


def _key_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The attribute flags given: a value, or None where `none` clears it."""
    given = {name: getattr(args, name) for name in KEY_FLAGS if getattr(args, name) is not None}
    return {name: (None if value == NONE else value) for name, value in given.items()}


def _key_summary(key: Any) -> str:
    """A key's attributes in one line, as they are now."""
    limit = "no spend limit" if key.spend_limit is None else f"spend limit ${decimal_text(key.spend_limit)}"
    period = "in total" if key.spend_period == "total" else f"per {key.spend_period}"
    return ", ".join([
        f"label {key.label!r}" if key.label is not None else "no label",
        f"role {key.role}",
        f"models {','.join(key.models)}" if key.models is not None else "every model",
        f"concurrency {key.concurrency}" if key.concurrency is not None else "the org's concurrency",
        limit if key.spend_limit is None else f"{limit} {period}",
    ])


def _keys_create(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.keys import create_key

    attributes = {name: value for name, value in _key_flags(args).items() if value is not None}
    key = create_key(ctx.tables, args.org, known_models=_known_models(ctx, attributes), **attributes)
    try:
        out(f"created key {key.key_id} for org {key.org_id}")
        out(f"secret (shown once, store it now): {key.secret}")
        sys.stdout.flush()  # written to the pipe; if its reader already left, the operator is told below
    except BrokenPipeError:
        print(f"kiln admin: key {key.key_id} was created, but its secret could not be written (the output's "
              f"reader left): revoke it (kiln admin keys revoke {key.key_id}) and create another", file=sys.stderr)
        raise
    if attributes:
        out(f"  {_key_summary(key)}")


def _with_keyring(ctx: Context, use: Callable[[Any], Any]) -> Any:
    """`use(keyring)` on key management of these tables, the usage events included (a key's
    spend without a limit is summed from them, and a new limit's figure seeded from them)."""
    from kiln.store.keys import with_keyring

    return with_keyring(ctx.tables, use)


def _keys_update(ctx: Context, args: argparse.Namespace, out) -> None:
    changes = _key_flags(args)
    if not changes:
        raise AdminError("nothing to change: give --label, --role, --models, --concurrency, --spend-limit "
                         "or --spend-period (none clears one)")
    known = _known_models(ctx, changes)
    key = _with_keyring(ctx, lambda keyring: keyring.update(args.key_id, changes, known_models=known))
    out(f"updated key {key.key_id} ({key.prefix}…) of org {key.org_id}: {_key_summary(key)}")
    out("  the gateway applies it within its auth cache time")


def _keys_revoke(ctx: Context, args: argparse.Namespace, out) -> None:
    key = _with_keyring(ctx, lambda keyring: keyring.revoke(args.key_id))
    out(f"revoked key {key.key_id} ({key.prefix}…) of org {key.org_id}")


KEY_COLUMNS = ("key_id", "prefix", "status", "created_at", "last_used_at", "revoked_at", "label", "role", "models",
               "concurrency", "spend_limit", "spend_period", "spend")


def _keys_list(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import valid_org_id

    if not valid_org_id(args.org):  # no org has it: DynamoDB would refuse an empty key's query
        raise AdminError(f"org {args.org[:80]!r} not found")

    async def describe(keyring: Any) -> list[dict[str, Any]]:
        # each key's spend this period: its figure (a key with a limit), else its tally
        # (kiln.store.tally), every key's read in batches
        return await keyring.describe(args.org, await keyring.list(args.org))

    rows = [
        {
            **key,
            "key_id": key["id"],
            "prefix": key["prefix"] + "…",
            "models": ",".join(key["models"]) if key["models"] is not None else None,
        }
        for key in _with_keyring(ctx, describe)
    ]
    render(rows, KEY_COLUMNS, args.format, out)


class _Progress:
    """How far a long command got, on stderr: on a terminal one line rewritten in place, else (with
    --progress) a line each time."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._terminal = sys.stderr.isatty()
        self._shown = args.progress or self._terminal

    def say(self, text: str) -> None:
        if self._shown:
            print(f"kiln admin: {text}", end="\r" if self._terminal else "\n", file=sys.stderr, flush=True)

    def end(self) -> None:
        """The line rewritten in place is left as it last was."""
        if self._shown and self._terminal:
            print(file=sys.stderr)


def _keys_tally(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import list_orgs
    from kiln.store.tally_backfill import TallyBackfill

    orgs = args.org or [org.org_id for org in list_orgs(ctx.tables)]
    shown = _Progress(args)

    def progress(done: TallyBackfill) -> None:
        shown.say(f"{done.added + done.found_tallied} usage events tallied…")

    async def tally(keyring: Any) -> tuple[TallyBackfill, int]:
        total, keys = TallyBackfill(), 0
        for org_id in orgs:
            done, marked = await keyring.tally_events(org_id, progress=progress)
            shown.end()
            out(f"org {org_id}: {_tallied_line(done)}; {_counted(len(marked), 'key')} marked tallied")
            total += done
            keys += len(marked)
        return total, keys

    total, keys = _with_keyring(ctx, tally)
    out(f"tallied {_counted(len(orgs), 'org')}: {_tallied_line(total)}; {_counted(keys, 'key')} marked tallied")


def _keys_recount(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import get_org, list_orgs

    for org_id in args.org:
        get_org(ctx.tables, org_id)  # not found: before any is written
    orgs = args.org or [org.org_id for org in list_orgs(ctx.tables)]

    async def recount(keyring: Any) -> int:
        changed = 0
        for org_id in orgs:
            before, now = await keyring.recount_limited(org_id)
            changed += before != now
            was = "none" if before is None else str(before)
            out(f"org {org_id}: {_counted(now, 'key')} with a spend limit (the count was {was})")
        return changed

    changed = _with_keyring(ctx, recount)
    out(f"recounted {_counted(len(orgs), 'org')}: {changed} changed")


def _tallied_line(done: Any) -> str:
    line = f"{_counted(done.added, 'usage event')} added to the keys' tallies (${decimal_text(done.cost)})"
    if done.found_tallied:
        line += f", {done.found_tallied} found tallied already"
    return line


def _counted(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _credits_add(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import add_credits, get_org

    add_credits(ctx.tables, args.org, args.usd)
    balance = get_org(ctx.tables, args.org).credits
    out(f"org {args.org}: added ${decimal_text(args.usd)}, balance ${decimal_text(balance)}")


DEBIT_COLUMNS = ("created_at", "gen_id", "model", "status", "prompt_tokens", "completion_tokens", "cost")


def _credits_show(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import get_org
    from kiln.store.usage import recent_events

    org = get_org(ctx.tables, args.org)
    debits = [event.as_dict() for event in recent_events(ctx.tables, args.org, args.last)]
    if args.format == "json":
        import json

        document = {"org_id": org.org_id, "balance": decimal_text(org.credits), "debits": debits}
        return out(json.dumps(document, default=lambda value: decimal_text(value), indent=2))
    if args.format == "table":
        out(f"org {org.org_id}: balance ${decimal_text(org.credits)}")
        out(f"latest {len(debits)} debits:" if debits else "no debits yet")
        if not debits:
            return
    render(debits, DEBIT_COLUMNS, args.format, out)


def _usage(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.orgs import get_org
    from kiln.store.usage import query_events

    org = get_org(ctx.tables, args.org)
    if args.since and args.until and args.since >= args.until:
        raise AdminError(f"--since ({args.since}) must be before --until ({args.until})")
    _say_what_expired(ctx.settings, max(args.since or "", org.created_at or ""))
    shown = _Progress(args)
    events = (event for event in query_events(ctx.tables, args.org, args.since, args.until) if in_span(event, args.until))
    summary = summarize(events, args.by, lambda count: shown.say(f"{count} usage events read…"))
    shown.end()
    if args.format == "json":
        import json

        document = {
            "org_id": args.org, "since": args.since, "until": args.until, "by": args.by,
            "rows": summary.rows(), "total": summary.total.row("total"),
        }
        return out(json.dumps(document, default=lambda value: decimal_text(value), indent=2))
    rows = summary.rows()
    if args.format == "table":
        rows = [*rows, summary.total.row("TOTAL")]
        period = f"{args.since or 'the start'} to {args.until or 'now'}"
        out(f"usage of org {args.org}, {period}, by {args.by}:")
    render(rows, summary.columns(), args.format, out)


def _say_what_expired(settings: Any, since: str) -> None:
    """Say on stderr that a report reaching back past the usage retention is short: its events
    expired (DynamoDB's TTL), while the org's credits and its keys' spend still count them.
    `since`: where the report's events may begin (its --since, or the org's making)."""
    import time

    from kiln.store.clock import iso_ms

    days = getattr(settings, "usage_retention_days", 0) or 0
    if not days:
        return
    horizon = iso_ms(time.time() - days * 86400)
    if since < horizon:
        print(f"kiln admin: usage events expire {days} days after they are written (the usage retention): "
              f"requests before {horizon[:10]} may be missing from this report, though the org's credits and its "
              f"keys' spend count them", file=sys.stderr)


def _generation(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store.usage import get_event

    event = get_event(ctx.tables, args.gen_id).as_dict()
    if args.format == "table":
        width = max(len(name) for name in event)
        for name, value in event.items():
            out(f"{name:<{width}}  {'-' if value is None else (decimal_text(value) if isinstance(value, Decimal) else value)}")
        return
    if args.format == "json":
        import json

        return out(json.dumps(event, default=lambda value: decimal_text(value), indent=2))
    render([event], tuple(event), args.format, out)


def _replay_usage(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.store import with_ledger

    from .replay import replay, unsettled_records

    if args.file == "-":
        lines = sys.stdin
    else:
        try:
            # a line that is no UTF-8 (another program's, in the same log) is not a record: read
            # as the standard input is, it cannot stop the others
            lines = open(args.file, encoding="utf-8", errors="surrogateescape")
        except OSError as exc:
            raise AdminError(f"cannot read {args.file}: {exc.strerror}") from None
    unreadable: list[str] = []
    failures: list[str] = []
    records = list(unsettled_records(lines, unreadable))
    shown = _Progress(args)

    def progress(done: int, total: int) -> None:
        shown.say(f"{done} of {total} usage events replayed…")

    outcomes = with_ledger(ctx.settings, lambda ledger: replay(ledger, records, failures, progress))
    shown.end()
    for problem in unreadable:
        print(f"kiln admin: {args.file}, {problem}: a usage_unsettled record that is no usage event", file=sys.stderr)
    for problem in failures:
        print(f"kiln admin: {problem}", file=sys.stderr)
    total = sum(outcomes.values())
    details = ", ".join(f"{count} {outcome.replace('_', ' ')}" for outcome, count in sorted(outcomes.items()))
    if unreadable:
        details += f"{', ' if details else ''}{len(unreadable)} unreadable"
    out(f"replayed {total} unsettled usage events" + (f": {details}" if details else ""))
    if failures or unreadable or outcomes.get("not_tried"):
        stopped = (f"; storage still failing, {outcomes['not_tried']} not tried" if outcomes.get("not_tried") else "")
        found = (f", {outcomes['not_found']} not found (an unknown org or generation, or an event past the usage "
                 "retention: a replay cannot settle those)" if outcomes.get("not_found") else "")
        raise AdminError(f"{outcomes.get('not_settled', 0)} not settled{found}, {len(unreadable)} unreadable{stopped}: "
                         "the others are settled; replaying the same lines again settles what it can and changes "
                         "nothing else")


def _read_catalog_file(path: str) -> tuple[str, str | None, Any]:
    """What to store of the file (_catalog_value: its text, or that text compact), a note when
    it is not the file as written, and its validated catalog; a bad file is an AdminError and
    writes nothing."""
    from kiln.catalog import Catalog, CatalogError

    try:
        raw = open(path, encoding="utf-8-sig").read()  # a byte order mark, as some editors write, is no JSON
    except OSError as exc:
        raise AdminError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise AdminError(f"{path} is not UTF-8 text (byte {exc.start})") from None
    try:
        catalog = Catalog.from_json(raw, written=True)
    except CatalogError as exc:
        raise AdminError(f"{path}: {exc}") from None
    return (*_catalog_value(raw, path), catalog)


def _catalog_value(raw: str, path: str) -> tuple[str, str | None]:
    """The text to store for a checked catalog file, and a note when it is not the file's own:
    the file as written if SSM can hold it, else the same JSON without its spaces."""
    from .provision import PARAMETER_VALUE_LIMITS

    limit = PARAMETER_VALUE_LIMITS["Advanced"]
    if len(raw) <= limit:
        return raw, None
    import json

    compact = json.dumps(json.loads(raw), separators=(",", ":"), ensure_ascii=False)
    if len(compact) > limit:
        raise AdminError(f"{path}: {len(compact)} characters even without spaces; an SSM parameter holds "
                         f"{limit}: fewer models or backends per catalog")
    return compact, f"stored compact: {len(compact)} of {limit} characters ({len(raw)} as written)"


def _stored_catalog_parsed(ctx: Context, raw: str) -> Any:
    """The stored catalog's models; one the gateway could not read either is said to be the stored one."""
    from kiln.catalog import Catalog, CatalogError

    try:
        return Catalog.from_json(raw)
    except CatalogError as exc:
        raise AdminError(f"the stored catalog {ctx.settings.catalog_parameter} is malformed ({exc}): "
                         "replace it with catalog set FILE") from None


def _stored_catalog(ctx: Context) -> str | None:
    try:
        return ctx.ssm.get_parameter(Name=ctx.settings.catalog_parameter)["Parameter"]["Value"]
    except ctx.ssm.exceptions.ParameterNotFound:
        return None


def _model_lines(catalog: Any) -> list[str]:
    lines = []
    for model in catalog:
        backends = ", ".join(
            f"{escaped(backend.name)}{'' if backend.enabled else ' (disabled)'}" for backend in model.backends
        ) or "no backend"
        prices = f"${decimal_text(model.pricing.input)} in / ${decimal_text(model.pricing.output)} out per 1M tokens"
        lines.append(f"  {escaped(model.id)}: {prices}; backends {backends}")  # a stored one may hold anything
    return lines


def _changes(before: Any, after: Any) -> str:
    """What a new catalog adds, removes and changes, by model id."""
    old = {model.id: model for model in before} if before is not None else {}
    new = {model.id: model for model in after}
    parts = [
        (label, ids)
        for label, ids in (
            ("added", [i for i in new if i not in old]),
            ("removed", [i for i in old if i not in new]),
            ("changed", [i for i in new if i in old and new[i] != old[i]]),
        )
        if ids
    ]
    return "; ".join(f"{label} {', '.join(map(escaped, ids))}" for label, ids in parts) or "no model changed"


def _catalog_set(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.catalog import Catalog, CatalogError

    value, note, catalog = _read_catalog_file(args.file)
    stored = _stored_catalog(ctx)
    try:
        before = Catalog.from_json(stored) if stored is not None else None
    except CatalogError:
        before = None  # a broken stored catalog is what this replaces
    ctx.ssm.put_parameter(
        Name=ctx.settings.catalog_parameter, Value=value, Type="String", Overwrite=True, Tier="Advanced"
    )
    models = ", ".join(model.id for model in catalog)
    out(f"catalog set: {len(catalog)} models ({models}); functions pick it up within their catalog cache time")
    if note:
        out(f"  {note}")
    out(f"  {_changes(before, catalog)}")
    for line in _model_lines(catalog):
        out(line)


def _catalog_seed(ctx: Context, args: argparse.Namespace, out) -> None:
    from .template import repo_root

    path = args.file or str(repo_root() / "infra" / "catalog.json")
    value, note, catalog = _read_catalog_file(path)
    name = ctx.settings.catalog_parameter
    try:
        ctx.ssm.put_parameter(Name=name, Value=value, Type="String", Overwrite=False, Tier="Advanced")
    except ctx.ssm.exceptions.ParameterAlreadyExists:
        existing = _stored_catalog_parsed(ctx, _stored_catalog(ctx) or '{"models": []}')
        out(f"catalog {name} already exists ({len(existing)} models): left as it is; change it with catalog set")
        return
    out(f"catalog seeded in {name} from {path}: {len(catalog)} models" + (f"; {note}" if note else ""))
    for line in _model_lines(catalog):
        out(line)


def _catalog_show(ctx: Context, args: argparse.Namespace, out) -> None:

    raw = _stored_catalog(ctx)
    if raw is None:
        raise AdminError(
            f"no catalog parameter {ctx.settings.catalog_parameter}: create it with catalog seed (or catalog set FILE)"
        )
    if not args.summary:
        return out(raw)
    catalog = _stored_catalog_parsed(ctx, raw)
    out(f"catalog {ctx.settings.catalog_parameter}: {len(catalog)} models")
    for line in _model_lines(catalog):
        out(line)


def _key_parameter(ctx: Context) -> str:
    name = ctx.settings.upstream_api_key_parameter
    if not name:
        raise AdminError("no upstream key parameter: use --stack, or set KILN_UPSTREAM_API_KEY_PARAMETER")
    return name


def _upstream_key_set(ctx: Context, args: argparse.Namespace, out) -> None:
    """The key comes from standard input, never the command line (shell history, ps)."""
    import getpass

    name = _key_parameter(ctx)
    key = sys.stdin.readline().strip() if not sys.stdin.isatty() else getpass.getpass("upstream key: ").strip()
    if not key:
        raise AdminError("no key on standard input (pipe it in, e.g. from a password manager)")
    extra = {"KeyId": args.kms_key_id} if args.kms_key_id else {}
    answer = ctx.ssm.put_parameter(Name=name, Value=key, Type="SecureString", Overwrite=True, **extra)
    out(f"upstream key stored in {name} (version {answer.get('Version', '?')}); "
        "functions use it within their key cache time, with no deploy")


def _upstream_key_status(ctx: Context, args: argparse.Namespace, out) -> None:
    name = _key_parameter(ctx)
    found = ctx.ssm.describe_parameters(ParameterFilters=[{"Key": "Name", "Values": [name]}]).get("Parameters", [])
    if not found:
        raise AdminError(f"no upstream key in {name}: store one with upstream-key set")
    info = found[0]
    changed = info.get("LastModifiedDate")
    when = changed.isoformat() if hasattr(changed, "isoformat") else changed
    out(f"upstream key {name}: {info.get('Type')}, version {info.get('Version')}, last changed {when}")


def _maintenance_on(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.maintenance import MaintenanceFlag

    until = args.until
    flag = MaintenanceFlag(enabled=True, until=until, message=args.message)
    _write_flag(ctx, flag)
    out(f"maintenance on: {flag.to_json()}")
    if until is not None and until <= datetime.now(timezone.utc):
        seconds = ctx.settings.maintenance_retry_after_seconds
        out(f"note: --until {json.loads(flag.to_json())['until']} has passed: clients are told "
            f"Retry-After: {seconds} (seconds) instead")


def _maintenance_off(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.maintenance import MaintenanceFlag

    _write_flag(ctx, MaintenanceFlag(enabled=False))
    out("maintenance off")


def _maintenance_status(ctx: Context, args: argparse.Namespace, out) -> None:
    from kiln.maintenance import parse_flag

    try:
        raw = ctx.ssm.get_parameter(Name=ctx.settings.maintenance_parameter)["Parameter"]["Value"]
    except ctx.ssm.exceptions.ParameterNotFound:
        raw = None
    flag = parse_flag(raw)
    out(f"maintenance {'on' if flag.enabled else 'off'}: {flag.to_json()}")


def _write_flag(ctx: Context, flag: Any) -> None:
    from .provision import PARAMETER_VALUE_LIMITS

    value = flag.to_json()
    # the switch is a standard parameter where kiln admin first writes it on a deployed stack
    limit = PARAMETER_VALUE_LIMITS["Standard"]
    if len(value.encode()) > limit:
        raise AdminError(f"the maintenance switch would be {len(value.encode())} bytes, over SSM's {limit} for a "
                         f"standard parameter: shorten --message")
    ctx.ssm.put_parameter(Name=ctx.settings.maintenance_parameter, Value=value, Type="String", Overwrite=True)

