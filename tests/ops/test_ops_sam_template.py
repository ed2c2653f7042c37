"""template.yaml: streaming and buffered wiring, REST API and Function URLs, IAM, alarms.

The template serves both modes through the InvokeMode parameter. These tests resolve its
conditions for each mode and check that every function's invoke mode matches the
integration in front of it (a streaming function behind a buffered integration, or the
reverse, corrupts bodies).
"""

from __future__ import annotations

from typing import Any

import pytest

from kiln_ops.template import load_template

STREAMING_FUNCTIONS = ("ChatCompletionsFunction", "CompletionsFunction")
BUFFERED_FUNCTIONS = ("ModelsFunction", "GenerationsFunction")
FUNCTIONS = (*STREAMING_FUNCTIONS, *BUFFERED_FUNCTIONS)
PATHS = {"ChatCompletionsFunction": "/v1/chat/completions", "CompletionsFunction": "/v1/completions"}
NO_VALUE = object()


def resolve(node: Any, mode: str) -> Any:
    """The template as CloudFormation would see it with InvokeMode=mode (conditions only)."""
    conditions = {"Streaming": mode == "streaming"}
    if isinstance(node, dict):
        if set(node) == {"Fn::If"}:
            name, when_true, when_false = node["Fn::If"]
            return resolve(when_true if conditions[name] else when_false, mode)
        if node == {"Ref": "AWS::NoValue"}:
            return NO_VALUE
        resolved = {key: resolve(value, mode) for key, value in node.items()}
        return {key: value for key, value in resolved.items() if value is not NO_VALUE}
    if isinstance(node, list):
        return [item for item in (resolve(item, mode) for item in node) if item is not NO_VALUE]
    return node


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return load_template()


def function(template, name: str, mode: str) -> dict[str, Any]:
    properties = dict(template["Globals"]["Function"])
    properties.update(template["Resources"][name]["Properties"])
    properties["Environment"] = {
        "Variables": {
            **template["Globals"]["Function"]["Environment"]["Variables"],
            **template["Resources"][name]["Properties"].get("Environment", {}).get("Variables", {}),
        }
    }
    return resolve(properties, mode)


def integration(template, path: str, mode: str) -> dict[str, Any]:
    body = template["Resources"]["GatewayApi"]["Properties"]["DefinitionBody"]
    return resolve(body["paths"][path]["post"]["x-amazon-apigateway-integration"], mode)


def web_adapter_layers(layers) -> list:
    return [layer for layer in layers if "LambdaAdapterLayer" in str(layer)]


def test_runtime_architecture_memory_and_timeouts(template):
    for name in FUNCTIONS:
        props = function(template, name, "streaming")
        assert props["Runtime"] == "python3.13"
        assert props["Architectures"] == ["arm64"]
        assert 512 <= props["MemorySize"] <= 3008
        assert {"Ref": "GatewayLayer"} in props["Layers"]
    for name in STREAMING_FUNCTIONS:
        assert function(template, name, "streaming")["Timeout"] == 900  # Lambda's ceiling: streams run long
    for name in BUFFERED_FUNCTIONS:
        assert function(template, name, "streaming")["Timeout"] <= 29  # behind a buffered REST integration


@pytest.mark.parametrize("name", STREAMING_FUNCTIONS)
def test_streaming_mode_runs_the_web_adapter_in_response_stream_mode(template, name):
    props = function(template, name, "streaming")
    env = props["Environment"]["Variables"]
    assert props["Handler"] == "run.sh"
    assert env["AWS_LAMBDA_EXEC_WRAPPER"] == "/opt/bootstrap"
    assert env["AWS_LWA_INVOKE_MODE"] == "response_stream"
    assert env["AWS_LWA_READINESS_CHECK_PATH"] == "/healthz"
    (adapter,) = web_adapter_layers(props["Layers"])
    assert "LambdaAdapterLayerArm64" in adapter["Fn::Sub"]
    assert props["FunctionUrlConfig"] == {"AuthType": "NONE", "InvokeMode": "RESPONSE_STREAM"}
    rest = integration(template, PATHS[name], "streaming")
    assert rest["responseTransferMode"] == "STREAM"
    assert rest["uri"]["Fn::Sub"].endswith(f"/2021-11-15/functions/${{{name}.Arn}}/response-streaming-invocations")
    assert rest["timeoutInMillis"] == 900000
    assert rest["type"] == "aws_proxy"


@pytest.mark.parametrize("name", FUNCTIONS)
def test_buffered_mode_is_a_mangum_handler_without_the_web_adapter(template, name):
    props = function(template, name, "buffered")
    env = props["Environment"]["Variables"]
    assert props["Handler"] == "app.handler"
    assert not web_adapter_layers(props["Layers"])  # sam local start-api downloads no layer
    assert not [var for var in env if var.startswith(("AWS_LWA_", "AWS_LAMBDA_EXEC_WRAPPER"))]
    if name in PATHS:
        assert props["FunctionUrlConfig"]["InvokeMode"] == "BUFFERED"
        rest = integration(template, PATHS[name], "buffered")
        assert rest["responseTransferMode"] == "BUFFERED"
        assert rest["uri"]["Fn::Sub"].endswith(f"/2015-03-31/functions/${{{name}.Arn}}/invocations")
        assert rest["timeoutInMillis"] <= 29000


@pytest.mark.parametrize(
    "name,routes",
    [
        ("ModelsFunction", {("GET", "/v1/models"), ("GET", "/v1/models/{model_id}")}),
        ("GenerationsFunction", {("GET", "/v1/generations/{gen_id}")}),
    ],
)
def test_models_and_generations_are_buffered_in_both_modes_and_routed_by_the_rest_api(template, name, routes):
    for mode in ("streaming", "buffered"):
        props = function(template, name, mode)
        assert props["Handler"] == "app.handler"
        assert not web_adapter_layers(props["Layers"])
        assert "FunctionUrlConfig" not in props
    events = template["Resources"][name]["Properties"]["Events"]
    assert {(e["Properties"]["Method"], e["Properties"]["Path"]) for e in events.values()} == routes
    assert all(e["Type"] == "Api" and e["Properties"]["RestApiId"] == {"Ref": "GatewayApi"} for e in events.values())


def test_the_rest_api_may_invoke_the_streaming_functions(template):
    resources = template["Resources"]
    for name, path in PATHS.items():
        permissions = [
            r["Properties"]
            for r in resources.values()
            if r["Type"] == "AWS::Lambda::Permission" and r["Properties"]["FunctionName"] == {"Ref": name}
        ]
        (permission,) = permissions
        assert permission["Principal"] == "apigateway.amazonaws.com"
        assert permission["SourceArn"]["Fn::Sub"].endswith(f"${{GatewayApi}}/*/POST{path}")


def test_ssm_parameters_and_their_environment(template):
    resources = template["Resources"]
    assert resources["MaintenanceParameter"]["Properties"]["Value"] == '{"enabled": false}'
    assert resources["CatalogParameter"]["Type"] == "AWS::SSM::Parameter"
    env = template["Globals"]["Function"]["Environment"]["Variables"]
    assert env["KILN_MAINTENANCE_PARAMETER"] == {"Ref": "MaintenanceParameter"}
    assert env["KILN_CATALOG_PARAMETER"] == {"Ref": "CatalogParameter"}
    for table in ("Keys", "Orgs", "Usage"):
        assert env[f"KILN_{table.upper()}_TABLE"] == {"Ref": f"{table}Table"}


def test_usage_events_expire_through_ttl(template):
    ttl = template["Resources"]["UsageTable"]["Properties"]["TimeToLiveSpecification"]
    assert ttl == {"AttributeName": "expires_at", "Enabled": True}


def _permission_statements(template) -> list[dict[str, Any]]:
    statements = []
    for name, resource in template["Resources"].items():
        if resource["Type"] == "AWS::IAM::Role":
            for policy in resource["Properties"].get("Policies", []):
                statements += [(name, s) for s in policy["PolicyDocument"]["Statement"]]
        if resource["Type"] == "AWS::Serverless::Function":
            assert "Policies" not in resource["Properties"], f"{name}: SAM's policies attach unscoped managed ones"
            assert "Role" in resource["Properties"], f"{name} needs its own least-privilege role"
    return statements


def test_no_iam_statement_with_a_wildcard_action_or_an_unscoped_resource(template):
    statements = _permission_statements(template)
    assert len(statements) >= 10
    for role, statement in statements:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        assert all("*" not in action for action in actions), (role, statement["Sid"])
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        assert all(resource != "*" for resource in resources), (role, statement["Sid"])


def test_each_role_grants_only_what_its_function_calls(template):
    def actions(role: str) -> set[str]:
        found = set()
        for name, statement in _permission_statements(template):
            if name == role:
                found.update(statement["Action"])
        return found

    gateway = {"logs:CreateLogStream", "logs:PutLogEvents", "dynamodb:GetItem", "dynamodb:UpdateItem", "dynamodb:PutItem", "ssm:GetParameter"}
    assert actions("ChatCompletionsRole") == gateway
    assert actions("CompletionsRole") == gateway
    # the models and generations functions neither admit nor bill: they write only a key's last use
    readers = gateway - {"dynamodb:PutItem"}
    assert actions("ModelsRole") == readers
    assert actions("GenerationsRole") == readers

    def resources(role: str, action: str) -> list:
        return [
            statement["Resource"]
            for name, statement in _permission_statements(template)
            if name == role and action in statement["Action"]
        ]

    for role in ("ModelsRole", "GenerationsRole"):
        assert resources(role, "dynamodb:UpdateItem") == [{"Fn::GetAtt": ["KeysTable", "Arn"]}]


def test_logs_alarms_dashboard_and_outputs(template):
    resources = template["Resources"]
    for name in FUNCTIONS:
        group = resources[name]["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
        assert resources[group]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    alarms = {name for name, r in resources.items() if r["Type"] == "AWS::CloudWatch::Alarm"}
    assert alarms == {
        "Gateway5xxRateAlarm",
        "UpstreamErrorsAlarm",
        "LambdaThrottlesAlarm",
        "DurationNearTimeoutAlarm",
        "RateLimitSurgeAlarm",
    }
    assert "Dashboard" in resources
    outputs = template["Outputs"]
    for name in ("ApiUrl", "ChatCompletionsFunctionUrl", "CompletionsFunctionUrl", "KeysTableName", "OrgsTableName",
                 "UsageTableName", "MaintenanceParameterName", "CatalogParameterName"):
        assert name in outputs
    assert outputs["ApiUrl"]["Value"]["Fn::Sub"].endswith("/prod/v1")


def test_alarms_watch_metrics_the_gateway_emits(template):
    """The custom alarms read metric names that kiln.observability really publishes."""
    import inspect

    from kiln import observability

    source = inspect.getsource(observability)
    resources = template["Resources"]
    names = []
    for alarm in ("UpstreamErrorsAlarm", "RateLimitSurgeAlarm"):
        names.append(resources[alarm]["Properties"]["MetricName"])
    for query in resources["Gateway5xxRateAlarm"]["Properties"]["Metrics"]:
        if "MetricStat" in query:
            names.append(query["MetricStat"]["Metric"]["MetricName"])
    for name in names:
        assert f'name="{name}"' in source, name
