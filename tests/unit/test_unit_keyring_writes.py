"""kiln.store.keyring's writes as DynamoDB may answer them: which are tried again, and how."""

import asyncio

import pytest

from kiln.aws import AwsError
from kiln.store.keyring import Keyring


class Dynamo:
    """UpdateItem applied (an ADD adds), its answer lost on the calls listed."""

    def __init__(self, lose: set[int], refuse: set[int] = frozenset()):
        self.figure, self.calls, self.lose, self.refuse = 0, 0, lose, refuse

    async def dynamodb(self, operation, payload, **options):
        self.calls += 1
        if self.calls in self.refuse:  # throttled: not applied
            raise AwsError("ProvisionedThroughputExceededException", "slow down")
        if payload["UpdateExpression"].startswith("ADD"):
            self.figure += int(payload["ExpressionAttributeValues"][":missing"]["N"])
        if self.calls in self.lose:
            raise AwsError("ConnectionError", "the connection closed before the answer", status=0)
        return {}


def _add(ring: Keyring):
    return ring._org_write("org1", "ADD #f :missing", {"#f": "spend"}, {":missing": {"N": "5"}}, idempotent=False)


def test_an_add_whose_answer_was_lost_is_not_sent_again():
    """Sent again, an ADD applied whose answer was lost is applied twice: the key's figure would
    count its spend twice and its limit be reached early."""
    dynamo = Dynamo(lose={1})
    with pytest.raises(Exception, match="ConnectionError"):
        asyncio.run(_add(Keyring(dynamo, keys_table="k", orgs_table="o")))
    assert (dynamo.calls, dynamo.figure) == (1, 5)


def test_an_add_refused_unapplied_is_tried_again_and_applied_once():
    dynamo = Dynamo(lose=set(), refuse={1, 2})
    assert asyncio.run(_add(Keyring(dynamo, keys_table="k", orgs_table="o"))) is True
    assert (dynamo.calls, dynamo.figure) == (3, 5)


def test_a_write_that_sets_is_sent_again_after_a_lost_answer():
    dynamo = Dynamo(lose={1, 2})
    ring = Keyring(dynamo, keys_table="k", orgs_table="o")
    assert asyncio.run(ring._org_write("org1", "REMOVE #f", {"#f": "spend"})) is True
    assert dynamo.calls == 3


def test_an_add_taken_on_a_kept_alive_connection_then_cut_is_not_sent_again_by_the_http_client():
    """Through the gateway's own AWS client: the ADD goes out on a kept-alive connection, the
    server applies it and closes without a word. The HTTP client sends such a request again on
    a new connection (right for a write that sets); an ADD so sent would be applied twice."""
    from kiln.aws import AwsClient, Credentials
    from kiln.http1 import HttpClient
    from kiln.tls import client_context

    async def main():
        figure, seen = [0], []

        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                      if line.lower().startswith(b"content-length")))
                    body = await reader.readexactly(length)
                except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
                    return
                seen.append(body)
                if b"ADD" in body:
                    figure[0] += 5  # applied…
                    if len(seen) == 2:  # …and, the first time, the connection cut before the answer
                        writer.transport.abort()
                        return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        aws = AwsClient(region="us-east-1", endpoint_url=url, http=HttpClient(ssl_context=client_context),
                        credentials=lambda: Credentials("a", "b"))
        ring = Keyring(aws, keys_table="k", orgs_table="o")
        assert await ring._org_write("org1", "SET #f = :v", {"#f": "x"}, {":v": {"N": "1"}})  # the connection, kept
        with pytest.raises(Exception, match="ConnectionError"):
            await ring._org_write("org1", "ADD #f :missing", {"#f": "spend"}, {":missing": {"N": "5"}}, idempotent=False)
        server.close()
        await aws.aclose()
        return figure[0], len(seen)

    assert asyncio.run(main()) == (5, 2)
