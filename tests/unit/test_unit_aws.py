"""kiln.aws: SigV4 exactly as AWS's own SDK signs, errors by code, retries only what may pass."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from unittest import mock
from urllib.parse import urlsplit

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest, AWSResponse
from botocore.credentials import Credentials as BotoCredentials
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.aws import AwsClient, AwsError, Credentials, sign
from kiln.http1 import ConnectFailed, Response

NOW = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)


def botocore_signed(url, headers, body, token, service="dynamodb", region="eu-west-1"):
    request = AWSRequest(method="POST", url=url, data=body, headers=headers)
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW.replace(tzinfo=None)):
        SigV4Auth(BotoCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token), service, region).add_auth(request)
    return request.headers


@pytest.mark.parametrize("token", [None, "session-token"])
@pytest.mark.parametrize("service,target", [("dynamodb", "DynamoDB_20120810.UpdateItem"), ("ssm", "AmazonSSM.GetParameter")])
def test_signatures_match_botocore(token, service, target):
    body = json.dumps({"TableName": "t", "Key": {"k": {"S": "ü"}}}).encode()
    content_type = "application/x-amz-json-1.0"
    url = f"https://{service}.eu-west-1.amazonaws.com/"
    ours = sign(
        credentials=Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token),
        region="eu-west-1", service=service, url=url,
        headers={"content-type": content_type, "x-amz-target": target}, body=body, now=NOW,
    )
    theirs = botocore_signed(url, {"Content-Type": content_type, "X-Amz-Target": target}, body, token, service)
    assert ours["authorization"] == theirs["Authorization"]
    assert ours["x-amz-date"] == theirs["X-Amz-Date"]
    if token:
        assert ours["x-amz-security-token"] == token


# -- any endpoint the settings accept, any header (hypothesis) -------------------------------

SEGMENT = st.sampled_from(["a", "B", "..", ".", "", "~x", "a%20b", "T%C3%BC", "x-y_z", "emu"])
ENDPOINTS = st.builds(
    lambda scheme, userinfo, host, port, segments, trailing, query: (
        f"{scheme}://{userinfo}{host}{port}" + ("/" + "/".join(segments) if segments is not None else "")
        + ("/" if trailing and segments is not None else "") + (f"?{query}" if query else "")
    ),
    st.sampled_from(["http", "https"]),
    st.sampled_from(["", "user@", "User:Secret@"]),
    st.sampled_from(["localhost", "LocalHost", "127.0.0.1", "[::1]", "DynamoDB.EU-West-1.amazonaws.com", "emu.internal"]),
    st.one_of(st.just(""), st.sampled_from([":80", ":443", ":4566", ":8000"]),
              st.integers(1, 65535).map(lambda port: f":{port}")),
    st.one_of(st.none(), st.lists(SEGMENT, max_size=4)),
    st.booleans(),
    st.one_of(st.just(""), st.sampled_from(["x=1&a=2", "b=&a=1", "Action=Go&a=2&a=1"])),
)
SPACED = st.text(st.sampled_from("aZ09/+=- \t"), max_size=24)
TOKENS = st.one_of(st.none(), SPACED.filter(lambda token: token.strip()))
# with those botocore leaves unsigned, which a proxy may change or drop on the way (the client
# sends a user-agent of its own for operators' calls)
HEADERS = st.dictionaries(st.sampled_from(["content-type", "x-amz-target", "x-custom", "x-amz-meta-thing", "user-agent",
                                           "User-Agent", "expect", "x-amzn-trace-id", "traceparent"]),
                          SPACED, max_size=4)


@settings(max_examples=300, deadline=None)
@given(url=ENDPOINTS, headers=HEADERS, token=TOKENS, body=st.binary(max_size=64))
def test_the_signer_matches_botocores_sigv4auth_for_any_endpoint_and_headers(url, headers, token, body):
    ours = sign(credentials=Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token), region="eu-west-1",
                service="dynamodb", url=url, headers=headers, body=body, now=NOW)
    theirs = botocore_signed(url, dict(headers), body, token)
    assert ours["authorization"] == theirs["Authorization"]


@settings(max_examples=40, deadline=None)
@given(url=ENDPOINTS, token=TOKENS)
def test_the_client_sends_what_a_botocore_client_sends_to_the_same_endpoint(url, token):
    """The URL, the Host and the signature of a whole call, against botocore's own client."""
    import botocore.session

    sent = {}

    def capture(request, **_):
        sent.update(url=request.url, headers=dict(request.headers))
        return AWSResponse(request.url, 200, {}, RawBody(b"{}"))

    client = botocore.session.get_session().create_client(
        "dynamodb", region_name="eu-west-1", endpoint_url=url, aws_access_key_id="AKIDEXAMPLE",
        aws_secret_access_key="wJalrXUtnFEMI/K7MDENG", aws_session_token=token)
    client.meta.events.register("before-send.dynamodb", capture)
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW.replace(tzinfo=None)):
        client.describe_limits()
    seen = []

    def handler(request):
        seen.append(request)
        return 200, {}

    ours = AwsClient(region="eu-west-1", endpoint_url=url, http=FakeHttp(handler), clock=lambda: NOW,
                     credentials=lambda: Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token))
    asyncio.run(ours.dynamodb("DescribeLimits", {}))
    (request,) = seen
    assert request.url == sent["url"]
    assert request.headers["authorization"] == sent["headers"]["Authorization"].decode()
    assert request.headers.get("x-amz-security-token") == (token or None)
    parts = urlsplit(url)
    assert request.headers["host"] == (f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname) + (
        f":{parts.port}" if parts.port not in (None, {"http": 80, "https": 443}[parts.scheme]) else "")


class RawBody:
    """What botocore reads an answer's body from."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def stream(self, **_):
        yield self._data

    def read(self, *_):
        data, self._data = self._data, b""
        return data


@pytest.mark.parametrize("url", ["ftp://x/", "http://", "localhost:4566", "http://h:port/"])
def test_an_endpoint_that_cannot_be_signed_is_refused_at_once(url):
    with pytest.raises(AwsError, match="endpoint URL"):
        AwsClient(region="us-east-1", endpoint_url=url, credentials=lambda: Credentials("a", "b"))


class Seen:
    """What the client sent: one request."""

    def __init__(self, url: str, headers: dict[str, str], body: bytes) -> None:
        self.url, self.headers, self.content = url, headers, body


class FakeHttp:
    """Answers each request with `handler(Seen) -> (status, body dict)`, or raises what it raises."""

    def __init__(self, handler) -> None:
        self.handler = handler

    async def request(self, method, url, *, headers, body, **_):
        status, answer = self.handler(Seen(url, headers, body))
        return Response.complete(status, json.dumps(answer).encode())

    async def aclose(self):
        pass


def _client(handler, **kwargs) -> AwsClient:
    return AwsClient(region="us-east-1", http=FakeHttp(handler), credentials=lambda: Credentials("a", "b"), **kwargs)


def test_a_call_posts_the_payload_to_the_regional_endpoint_with_its_target():
    seen = []

    def handler(request):
        seen.append(request)
        return 200, {"Item": {"k": {"S": "v"}}}

    answer = asyncio.run(_client(handler).dynamodb("GetItem", {"TableName": "t"}))
    assert answer == {"Item": {"k": {"S": "v"}}}
    (request,) = seen
    assert request.url == "https://dynamodb.us-east-1.amazonaws.com/"
    assert request.headers["x-amz-target"] == "DynamoDB_20120810.GetItem"
    assert json.loads(request.content) == {"TableName": "t"}
    assert request.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=a/")


def test_a_payload_is_sent_as_utf8_json_and_one_utf8_cannot_hold_with_escapes():
    """Non-ASCII text goes as UTF-8 (what DynamoDB reads); a lone surrogate, which UTF-8 cannot
    hold, still goes, escaped, rather than failing the call inside the gateway."""
    seen = []

    def handler(request):
        seen.append(request)
        return 200, {}

    for text in ("clé ☃", "\ud800 lone"):
        asyncio.run(_client(handler).dynamodb("PutItem", {"Item": {"k": {"S": text}}, "N": 10**30}))
        assert json.loads(seen[-1].content) == {"Item": {"k": {"S": text}}, "N": 10**30}
    assert "clé ☃".encode() in seen[0].content
    assert seen[1].content.isascii()


def test_errors_come_back_by_code_with_their_body():
    def handler(request):
        return 400, {"__type": "com.amazonaws.dynamodb.v20120810#ConditionalCheckFailedException",
                     "message": "The conditional request failed", "Item": {"k": {"S": "old"}}}

    with pytest.raises(AwsError) as caught:
        asyncio.run(_client(handler).dynamodb("UpdateItem", {}))
    assert caught.value.code == "ConditionalCheckFailedException"
    assert caught.value.body["Item"] == {"k": {"S": "old"}}


def test_throttling_and_5xx_are_retried_request_errors_are_not():
    calls = {"throttled": 0, "refused": 0}

    def throttled(request):
        calls["throttled"] += 1
        if calls["throttled"] < 3:
            return 400, {"__type": "x#ProvisionedThroughputExceededException", "message": "slow down"}
        return 200, {}

    def refused(request):
        calls["refused"] += 1
        return 400, {"__type": "x#ValidationException", "message": "bad"}

    assert asyncio.run(_client(throttled, max_attempts=3).dynamodb("PutItem", {})) == {}
    assert calls["throttled"] == 3
    with pytest.raises(AwsError):
        asyncio.run(_client(refused, max_attempts=3).dynamodb("PutItem", {}))
    assert calls["refused"] == 1


def test_a_service_that_cannot_be_reached_is_an_aws_error_after_the_retries():
    def unreachable(request):
        raise ConnectFailed("refused")

    with pytest.raises(AwsError) as caught:
        asyncio.run(_client(unreachable, max_attempts=2).ssm("GetParameter", {"Name": "/x"}))
    assert caught.value.code == "ConnectionError"


def test_an_endpoint_override_reaches_every_service_there():
    seen = []

    def handler(request):
        seen.append(request.url)
        return 200, {}

    client = AwsClient(region="us-east-1", endpoint_url="http://127.0.0.1:4566/", http=FakeHttp(handler),
                       credentials=lambda: Credentials("a", "b"))
    asyncio.run(client.dynamodb("GetItem", {}))
    asyncio.run(client.ssm("GetParameter", {}))
    assert seen == ["http://127.0.0.1:4566/", "http://127.0.0.1:4566/"]


@pytest.mark.parametrize("region, host", [("us-east-1", "dynamodb.us-east-1.amazonaws.com"),
                                          ("cn-north-1", "dynamodb.cn-north-1.amazonaws.com.cn"),
                                          ("cn-northwest-1", "dynamodb.cn-northwest-1.amazonaws.com.cn")])
def test_the_regional_endpoint_is_the_partitions(region, host):
    """template.yaml builds every ARN from AWS::Partition, so it deploys in China too, whose
    hosts end in .com.cn (as botocore's do)."""
    seen = []
    client = AwsClient(region=region, http=FakeHttp(lambda request: (seen.append(request.url), (200, {}))[1]),
                       credentials=lambda: Credentials("a", "b"))
    asyncio.run(client.dynamodb("GetItem", {}))
    assert seen == [f"https://{host}/"]


def test_a_client_that_tries_once_shares_the_connections_and_retries_nothing():
    calls = []

    def throttled(request):
        calls.append(request)
        return 400, {"__type": "x#ThrottlingException", "message": "Rate exceeded"}

    client = _client(throttled, max_attempts=3)
    once = client.once()
    with pytest.raises(AwsError, match="ThrottlingException"):
        asyncio.run(once.ssm("GetParameter", {"Name": "/x"}))
    assert len(calls) == 1 and once._http is client._http
    asyncio.run(once.aclose())  # not its connections to close
    with pytest.raises(AwsError):
        asyncio.run(client.ssm("GetParameter", {"Name": "/x"}))
    assert len(calls) == 4  # the client itself still tries 3 times


def test_a_throttled_first_read_is_as_many_ssm_calls_as_the_caches_back_off_tries():
    """docs/deploy.md (SSM reads): a new environment retries its first read of the catalog
    with back-off for up to 3 s, about 7 tries. Each try is one GetParameter, not one call of
    the AWS client that would try 3 times itself, against the very quota refusing them."""
    from kiln.errors import StorageUnavailable
    from kiln.gateway import Gateway
    from kiln.settings import Settings

    reads = []

    def throttled(request):
        reads.append(request)
        return 400, {"__type": "ThrottlingException", "message": "Rate exceeded"}

    settings = Settings.from_env({"KILN_PARAMETER_FIRST_READ_SECONDS": "3"})
    gateway = Gateway(settings, aws=_client(throttled, max_attempts=3))
    with pytest.raises(StorageUnavailable):
        asyncio.run(gateway.catalog())
    assert 3 <= len(reads) <= 8, len(reads)

