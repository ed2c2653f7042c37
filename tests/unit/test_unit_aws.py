"""kiln.aws: SigV4 exactly as AWS's own SDK signs, errors by code, retries only what may pass."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from unittest import mock

import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials as BotoCredentials

from kiln.aws import AwsClient, AwsError, Credentials, sign
from kiln.http1 import ConnectFailed, Response

NOW = datetime(2026, 11, 30, 10, 0, 0, tzinfo=timezone.utc)


@pytest.mark.parametrize("token", [None, "session-token"])
@pytest.mark.parametrize("service,target", [("dynamodb", "DynamoDB_20120810.UpdateItem"), ("ssm", "AmazonSSM.GetParameter")])
def test_signatures_match_botocore(token, service, target):
    body = json.dumps({"TableName": "t", "Key": {"k": {"S": "ü"}}}).encode()
    content_type = "application/x-amz-json-1.0"
    ours = sign(
        credentials=Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token),
        region="eu-west-1", service=service, host=f"{service}.eu-west-1.amazonaws.com",
        headers={"content-type": content_type, "x-amz-target": target}, body=body, now=NOW,
    )
    request = AWSRequest(method="POST", url=f"https://{service}.eu-west-1.amazonaws.com/", data=body,
                         headers={"Content-Type": content_type, "X-Amz-Target": target})
    with mock.patch("botocore.auth.get_current_datetime", return_value=NOW.replace(tzinfo=None)):
        SigV4Auth(BotoCredentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG", token), service, "eu-west-1").add_auth(request)
    assert ours["authorization"] == request.headers["Authorization"]
    assert ours["x-amz-date"] == request.headers["X-Amz-Date"]
    if token:
        assert ours["x-amz-security-token"] == token


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
