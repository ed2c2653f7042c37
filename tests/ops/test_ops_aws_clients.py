"""kiln admin's own botocore clients (DynamoDB, SSM, CloudFormation): how long they wait."""

from dataclasses import replace

import pytest

from kiln.settings import Settings
from kiln_ops.provision import aws_clients
from kiln_ops.stack import settings_from_stack


def _waits(config) -> tuple[float, float, int]:
    return config.connect_timeout, config.read_timeout, config.retries["total_max_attempts"]


def test_kiln_admins_clients_give_up_on_an_endpoint_that_never_answers_within_seconds():
    """botocore's own defaults (60 s to read, on each of its tries) held `kiln admin --stack …`
    and `maintenance status` three minutes on an endpoint that took the connection and never
    answered: they wait as the table models do (3 s to connect, 10 s to read, 3 tries)."""
    settings = replace(Settings.from_env(), aws_endpoint_url="http://127.0.0.1:9")
    for client in aws_clients(settings):
        assert _waits(client.meta.config) == (3, 10, 3)

    made = []

    class Session:
        def get_config_variable(self, name):
            return None

        def create_client(self, service, **kwargs):
            made.append((service, kwargs["config"]))
            raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        settings_from_stack("kiln", settings, session=Session())
    assert [(service, _waits(config)) for service, config in made] == [("cloudformation", (3, 10, 3))]
