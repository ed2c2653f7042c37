"""`kiln admin catalog …` and `kiln admin upstream-key …`, against the embedded AWS.

The stack owns neither the catalog nor the upstream key (template.yaml): operators create
them on the first deploy and change them with these commands, which validate before they
write and say what they did.
"""

from __future__ import annotations

import io
import json
import secrets
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser
from kiln_ops.template import repo_root
from support import catalog_for_tests

DEFAULT_CATALOG = repo_root() / "infra" / "catalog.json"


@dataclass
class Result:
    code: int
    lines: list[str]
    err: str


@pytest.fixture
def fresh(stack):
    """The test stack's settings with a catalog and an upstream key that do not exist yet."""
    prefix = f"/t{secrets.token_hex(5)}"
    return replace(stack.settings, catalog_parameter=f"{prefix}/catalog",
                   upstream_api_key_parameter=f"{prefix}/upstream-api-key")


@pytest.fixture
def admin(capsys):
    def run(settings, *argv: str, stdin: str | None = None) -> Result:
        capsys.readouterr()
        lines: list[str] = []
        try:
            args = build_parser().parse_args(["admin", *argv])
            if stdin is not None:
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr("sys.stdin", io.StringIO(stdin))
                    code = run_admin(args, settings=settings, out=lines.append)
            else:
                code = run_admin(args, settings=settings, out=lines.append)
        except SystemExit as exc:
            code = exc.code
        return Result(code, lines, capsys.readouterr().err)

    return run


def stored(stack, name: str) -> str:
    return stack.ssm.get_parameter(Name=name)["Parameter"]["Value"]


def write(tmp_path: Path, name: str, document) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return str(path)


def test_seed_creates_the_catalog_from_infra_catalog_json_on_first_deploy(admin, stack, fresh):
    result = admin(fresh, "catalog", "seed")
    assert result.code == 0, result.err
    models = [model["id"] for model in json.loads(DEFAULT_CATALOG.read_text())["models"]]
    assert result.lines[0] == f"catalog seeded in {fresh.catalog_parameter} from {DEFAULT_CATALOG}: {len(models)} models"
    assert [line.split(":")[0].strip() for line in result.lines[1:]] == models
    assert stored(stack, fresh.catalog_parameter) == DEFAULT_CATALOG.read_text()


def test_seed_never_overwrites_a_catalog_operators_changed(admin, stack, fresh, tmp_path):
    document = catalog_for_tests(stack.mock.url)
    document["models"] = document["models"][:1]
    assert admin(fresh, "catalog", "set", write(tmp_path, "mine.json", document)).code == 0
    before = stored(stack, fresh.catalog_parameter)

    again = admin(fresh, "catalog", "seed")  # e.g. a deploy script run a second time
    assert again.code == 0, again.err
    assert again.lines == [f"catalog {fresh.catalog_parameter} already exists (1 models): left as it is; "
                           "change it with catalog set"]
    assert stored(stack, fresh.catalog_parameter) == before


def test_seed_refuses_an_invalid_file_and_writes_nothing(admin, stack, fresh, tmp_path):
    result = admin(fresh, "catalog", "seed", write(tmp_path, "bad.json", '{"models": [{"id": "x"}]}'))
    assert result.code == 1 and "pricing" in result.err
    with pytest.raises(stack.ssm.exceptions.ParameterNotFound):
        stack.ssm.get_parameter(Name=fresh.catalog_parameter)


def test_set_summarizes_what_it_added_removed_and_changed(admin, stack, fresh, tmp_path):
    assert admin(fresh, "catalog", "seed").code == 0
    document = json.loads(DEFAULT_CATALOG.read_text())
    first, second = document["models"]
    first["pricing"]["output"] = "9.99"
    document["models"] = [first, {**second, "id": "new-model"}]

    result = admin(fresh, "catalog", "set", write(tmp_path, "next.json", document))
    assert result.code == 0, result.err
    assert result.lines[0].startswith("catalog set: 2 models (qwen3-32b, new-model)")
    assert result.lines[1] == f"  added new-model; removed {second['id']}; changed {first['id']}"
    assert "$9.99 out per 1M tokens" in result.lines[2]
    assert json.loads(stored(stack, fresh.catalog_parameter)) == document


def test_set_refuses_an_invalid_catalog_and_leaves_the_live_one(admin, stack, fresh, tmp_path):
    assert admin(fresh, "catalog", "seed").code == 0
    before = stored(stack, fresh.catalog_parameter)
    bad = catalog_for_tests(stack.mock.url)
    bad["models"][0]["pricing"]["input"] = 0.5  # a float price: refused
    result = admin(fresh, "catalog", "set", write(tmp_path, "bad.json", bad))
    assert result.code == 1 and result.lines == []
    assert "pricing.input" in result.err and result.err.count("\n") == 1
    assert stored(stack, fresh.catalog_parameter) == before


def test_show_prints_the_stored_json_or_a_summary(admin, stack, fresh):
    assert admin(fresh, "catalog", "seed").code == 0
    raw = admin(fresh, "catalog", "show")
    assert raw.lines == [DEFAULT_CATALOG.read_text()]  # as stored: `show > backup.json` round-trips
    summary = admin(fresh, "catalog", "show", "--summary")
    assert summary.lines[0] == f"catalog {fresh.catalog_parameter}: 2 models"
    assert summary.lines[1].startswith("  qwen3-32b: $0.08 in / $0.24 out per 1M tokens; backends qwen3-32b-a")


def test_a_catalog_stored_by_other_means_is_shown_with_its_odd_text_escaped_and_no_password(admin, stack, fresh):
    """A catalog written straight to SSM: `show --summary` printed an id holding a line break as
    two lines, and `backends` printed a backend URL's user:password, which is never sent."""
    document = {"models": [{"id": "a\nb", "context_length": 4096, "pricing": {"input": "1", "output": "1"},
                            "backends": [{"name": "x\u202ey", "url": "http://user:s3cretpw@127.0.0.1:9/v1"}]}]}
    stack.ssm.put_parameter(Name=fresh.catalog_parameter, Value=json.dumps(document), Type="String", Tier="Advanced")
    summary = admin(fresh, "catalog", "show", "--summary")
    assert summary.code == 0 and summary.lines[1].startswith("  a\\nb: $1 in / $1 out per 1M tokens; backends x\\u202ey")
    for output in ("table", "json", "csv"):
        listed = admin(fresh, "backends", "--format", output)
        assert listed.code == 0, listed.err
        assert "s3cretpw" not in "\n".join(listed.lines) and "127.0.0.1:9/v1" in "\n".join(listed.lines)


def test_show_without_a_catalog_says_how_to_create_one(admin, fresh):
    result = admin(fresh, "catalog", "show")
    assert result.code == 1
    assert result.err == f"kiln admin: no catalog parameter {fresh.catalog_parameter}: create it with catalog seed " \
                         "(or catalog set FILE)\n"


def test_upstream_key_set_reads_standard_input_and_stores_an_encrypted_secure_string(admin, stack, fresh):
    key = f"sk-upstream-{secrets.token_hex(8)}"
    result = admin(fresh, "upstream-key", "set", stdin=key + "\n")
    assert result.code == 0, result.err
    assert result.lines == [f"upstream key stored in {fresh.upstream_api_key_parameter} (version 1); "
                            "functions use it within their key cache time, with no deploy"]
    parameter = stack.ssm.get_parameter(Name=fresh.upstream_api_key_parameter, WithDecryption=True)["Parameter"]
    assert (parameter["Type"], parameter["Value"]) == ("SecureString", key)
    assert key not in result.err

    rotated = admin(fresh, "upstream-key", "set", stdin="sk-upstream-next\n")
    assert "(version 2)" in rotated.lines[0]
    status = admin(fresh, "upstream-key", "status")
    assert status.code == 0, status.err
    assert status.lines[0].startswith(f"upstream key {fresh.upstream_api_key_parameter}: SecureString, version 2, last changed ")
    assert "sk-upstream" not in "".join(status.lines)


def test_upstream_key_refuses_an_empty_key_and_says_when_none_is_stored(admin, fresh):
    empty = admin(fresh, "upstream-key", "set", stdin="\n")
    assert empty.code == 1 and "no key on standard input" in empty.err
    missing = admin(fresh, "upstream-key", "status")
    assert missing.code == 1 and "store one with upstream-key set" in missing.err
    nowhere = admin(replace(fresh, upstream_api_key_parameter=None), "upstream-key", "status")
    assert nowhere.code == 1 and "--stack" in nowhere.err


def test_stack_option_finds_the_catalog_and_the_upstream_key_in_the_outputs(admin, stack, fresh):
    import botocore.session

    from kiln.settings import Settings
    from kiln_ops.stack import OPTIONAL_OUTPUTS, OUTPUTS

    client = botocore.session.get_session().create_client(
        "cloudformation", region_name="us-east-1", endpoint_url=stack.settings.aws_endpoint_url
    )
    name = f"kiln-{secrets.token_hex(3)}"
    outputs = {output: {"Value": getattr(fresh, field)} for output, field in {**OUTPUTS, **OPTIONAL_OUTPUTS}.items()}
    client.create_stack(StackName=name, TemplateBody=json.dumps({
        "AWSTemplateFormatVersion": "2010-09-09",
        "Resources": {"Marker": {"Type": "AWS::SNS::Topic"}},
        "Outputs": {**outputs, "Region": {"Value": "us-east-1"}},
    }))
    try:
        elsewhere = replace(Settings(), aws_endpoint_url=stack.settings.aws_endpoint_url)
        assert admin(elsewhere, "--stack", name, "catalog", "seed").code == 0
        assert stored(stack, fresh.catalog_parameter) == DEFAULT_CATALOG.read_text()
        assert admin(elsewhere, "--stack", name, "upstream-key", "set", stdin="sk-upstream-x\n").code == 0
        assert "SecureString" in admin(elsewhere, "--stack", name, "upstream-key", "status").lines[0]
    finally:
        client.delete_stack(StackName=name)


def catalog_of(count: int) -> dict:
    """The repository's first model, `count` times under ids of its own."""
    model = json.loads(DEFAULT_CATALOG.read_text())["models"][0]
    return {"models": [{**model, "id": f"model-{i:03d}"} for i in range(count)]}


def count_for(size: int, **written) -> int:
    """How many models make a catalog of just over `size` characters, written so."""
    count = 1
    while len(json.dumps(catalog_of(count), **written)) <= size:
        count += 1
    return count


def test_a_catalog_ssm_cannot_hold_is_refused_before_anything_is_written(admin, stack, fresh, tmp_path):
    """An advanced parameter holds 8 192 characters: AWS would refuse a larger catalog after the
    file was read and checked. Refused up front, naming the sizes, the stored one unchanged."""
    assert admin(fresh, "catalog", "seed").code == 0
    before = stored(stack, fresh.catalog_parameter)
    big = catalog_of(count_for(8192, separators=(",", ":")))
    result = admin(fresh, "catalog", "set", write(tmp_path, "big.json", big))
    assert result.code == 1 and result.lines == [] and "8192" in result.err and result.err.count("\n") == 1
    assert stored(stack, fresh.catalog_parameter) == before


def test_a_catalog_that_fits_only_without_its_indentation_is_stored_compact(admin, stack, fresh, tmp_path):
    count = count_for(8192, indent=2)
    document = catalog_of(count)
    assert len(json.dumps(document, separators=(",", ":"))) <= 8192  # without spaces it fits
    path = tmp_path / "pretty.json"
    path.write_text(json.dumps(document, indent=2))
    result = admin(fresh, "catalog", "set", str(path))
    assert result.code == 0, result.err
    assert any("compact" in line for line in result.lines), result.lines
    assert json.loads(stored(stack, fresh.catalog_parameter)) == document


def test_a_stored_catalog_no_one_can_read_is_named_as_the_stored_one(admin, stack, fresh, tmp_path):
    """A deploy script runs catalog seed every time: when the stored catalog was broken by
    hand, its error says which catalog is broken and how to mend it, not just "not valid JSON"."""
    stack.ssm.put_parameter(Name=fresh.catalog_parameter, Value="{not json", Type="String", Tier="Advanced")
    for argv in (("catalog", "seed"), ("catalog", "show", "--summary"), ("backends",)):
        result = admin(fresh, *argv)
        assert result.code == 1 and result.err.count("\n") == 1, (argv, result)
        assert f"the stored catalog {fresh.catalog_parameter} is malformed" in result.err and "catalog set" in result.err


def test_a_catalog_file_that_is_not_utf8_is_named(admin, fresh, tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"models": [{"id": "café"}]}'.encode("latin-1"))
    result = admin(fresh, "catalog", "set", str(path))
    assert result.code == 1 and f"{path} is not UTF-8 text" in result.err


def test_a_catalog_file_with_a_misspelt_field_is_refused(admin, fresh, tmp_path):
    document = json.loads(DEFAULT_CATALOG.read_text())
    document["models"][0]["timeout"] = {"total": 30}
    result = admin(fresh, "catalog", "set", write(tmp_path, "typo.json", document))
    assert result.code == 1 and "'timeout'" in result.err
