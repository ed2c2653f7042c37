"""template.yaml as CloudFormation receives it, in every mode of the template.

Each mode is translated offline by SAM's own translator (`kiln_ops.template.translate`)
and its conditions resolved: what is checked here is what a `sam deploy` creates, not the
template's text nor SAM CLI's local view of it (which merges API events into an inline
OpenAPI body that the deployed API never gets).
"""

from __future__ import annotations

import itertools
import json
import re
import time
from decimal import Decimal
from typing import Any

import pytest

from kiln.endpoints import ENDPOINTS
from kiln_ops.template import PSEUDO_PARAMETERS, load_template, translate

# every route of the contract and the function behind it, as kiln.endpoints declares them
STREAMING_FUNCTIONS = tuple(endpoint.resource for endpoint in ENDPOINTS if endpoint.streaming)
BUFFERED_FUNCTIONS = tuple(endpoint.resource for endpoint in ENDPOINTS if not endpoint.streaming)
FUNCTIONS = (*STREAMING_FUNCTIONS, *BUFFERED_FUNCTIONS)
ROUTES = {(route.method.lower(), route.path): endpoint.resource for endpoint in ENDPOINTS for route in endpoint.routes}
STACK, REGION, ACCOUNT = PSEUDO_PARAMETERS["AWS::StackName"], PSEUDO_PARAMETERS["AWS::Region"], PSEUDO_PARAMETERS["AWS::AccountId"]
PARAMETER_ARN = f"arn:aws:ssm:{REGION}:{ACCOUNT}:parameter/{STACK}/{{}}"
KMS_KEY = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/1234abcd-12ab-34cd-56ef-1234567890ab"

# Every parameter value that changes which resources, routes or integrations exist.
CHOICES = {
    "InvokeMode": ["streaming", "buffered"],
    "FunctionUrls": ["none", "iam", "public"],
    "extras": ["defaults", "vpc-kms-existing-logs-role"],
}
EXTRAS = {
    "defaults": {},
    "vpc-kms-existing-logs-role": {
        "SubnetIds": "subnet-0a1b2c3d,subnet-4e5f6a7b",
        "SecurityGroupIds": "sg-0123456789abcdef0",
        "UpstreamApiKeyKmsKeyArn": KMS_KEY,
        "SetApiGatewayLogsRole": "false",
    },
}
MODES = [
    {"InvokeMode": invoke, "FunctionUrls": urls, **EXTRAS[extras]}
    for invoke, urls, extras in itertools.product(*CHOICES.values())
]


def mode_id(mode: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in mode.items() if k in ("InvokeMode", "FunctionUrls")) + (
        ",vpc+kms" if "SubnetIds" in mode else ""
    )


_TRANSLATED: dict[str, dict[str, Any]] = {}


def deployed(mode: dict[str, Any]) -> dict[str, Any]:
    key = json.dumps(mode, sort_keys=True)
    if key not in _TRANSLATED:
        _TRANSLATED[key] = translate(mode)
    return _TRANSLATED[key]


@pytest.fixture(params=MODES, ids=mode_id)
def mode(request) -> dict[str, Any]:
    return request.param


@pytest.fixture
def cfn(mode) -> dict[str, Any]:
    return deployed(mode)


def of_type(cfn: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in cfn["Resources"].items() if r["Type"] == kind}


def rest_api_body(cfn) -> dict[str, Any]:
    (api,) = of_type(cfn, "AWS::ApiGateway::RestApi").values()
    return api["Properties"]["Body"]


def streaming(mode) -> bool:
    return mode["InvokeMode"] == "streaming"


def integration_uri(function: str, stream: bool) -> str:
    if stream:
        return (f"arn:aws:apigateway:{REGION}:lambda:path/2021-11-15/functions/${{{function}.Arn}}"
                "/response-streaming-invocations")
    return f"arn:aws:apigateway:{REGION}:lambda:path/2015-03-31/functions/${{{function}.Arn}}/invocations"


def env(cfn, function: str) -> dict[str, Any]:
    return cfn["Resources"][function]["Properties"]["Environment"]["Variables"]


# -- the routes ---------------------------------------------------------------------------------


def test_the_registry_holds_at_least_the_contracts_routes():
    assert {("post", "/v1/chat/completions"), ("post", "/v1/completions"), ("get", "/v1/models"),
            ("get", "/v1/models/{model_id+}"), ("get", "/v1/generations/{gen_id}")} <= set(ROUTES)
    # §10: an org's self-service, behind the REST API in both modes like every route
    self_service = {("get", "/v1/credits"), ("get", "/v1/key"), ("get", "/v1/usage"), ("post", "/v1/keys"),
                    ("get", "/v1/keys"), ("get", "/v1/keys/{key_id}"), ("patch", "/v1/keys/{key_id}"),
                    ("delete", "/v1/keys/{key_id}")}
    assert {ROUTES[route] for route in self_service} == {"GenerationsFunction"}
    assert {"ChatCompletionsFunction", "CompletionsFunction"} <= set(STREAMING_FUNCTIONS)


def test_the_sam_local_check_expects_the_registrys_routes():
    """infra/sam_local_check.py runs in SAM CLI's environment, without the layer: its list is a copy."""
    import ast

    from kiln_ops.template import repo_root

    source = ast.parse((repo_root() / "infra" / "sam_local_check.py").read_text())
    (expected,) = [node.value for node in source.body
                   if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXPECTED_ROUTES"]
    routes = {(method.lower(), path): function for (method, path), function in ast.literal_eval(expected).items()}
    assert routes == ROUTES


def test_every_contract_route_is_on_the_deployed_rest_api_with_its_integration(cfn, mode):
    body = rest_api_body(cfn)
    routes = {(method, path) for path, item in body["paths"].items() for method in item}
    assert routes == set(ROUTES)
    for (method, path), function in ROUTES.items():
        integration = body["paths"][path][method]["x-amazon-apigateway-integration"]
        stream = streaming(mode) and function in STREAMING_FUNCTIONS
        assert integration["type"] == "aws_proxy", (method, path)
        assert integration["httpMethod"] == "POST", (method, path)  # Lambda is always invoked with POST
        assert integration["uri"] == {"Fn::Sub": integration_uri(function, stream)}, (method, path)
        assert integration["responseTransferMode"] == ("STREAM" if stream else "BUFFERED"), (method, path)
        if stream:
            assert integration["timeoutInMillis"] == 900_000
        else:
            assert integration["timeoutInMillis"] <= 29_000  # a buffered REST integration's ceiling


def test_each_function_runs_in_the_mode_of_the_integration_in_front_of_it(cfn, mode):
    """A streaming function behind a buffered integration (or the reverse) corrupts bodies."""
    for function in FUNCTIONS:
        props = cfn["Resources"][function]["Properties"]
        variables = env(cfn, function)
        adapter = [layer for layer in props["Layers"] if "LambdaAdapterLayer" in json.dumps(layer)]
        if streaming(mode) and function in STREAMING_FUNCTIONS:
            assert props["Handler"] == "run.sh"
            assert variables["AWS_LAMBDA_EXEC_WRAPPER"] == "/opt/bootstrap"
            assert variables["AWS_LWA_INVOKE_MODE"] == "response_stream"
            assert variables["AWS_LWA_READINESS_CHECK_PATH"] == "/healthz"
            assert adapter == [f"arn:aws:lambda:{REGION}:753240598075:layer:LambdaAdapterLayerArm64:27"]
            assert props["Timeout"] == 900
        else:
            assert props["Handler"] == "app.handler"  # Mangum
            assert adapter == []  # sam local start-api downloads no layer
            assert not [name for name in variables if name.startswith(("AWS_LWA_", "AWS_LAMBDA_EXEC_WRAPPER"))]
            assert props["Timeout"] <= 29 or function in STREAMING_FUNCTIONS


def test_the_rest_api_may_invoke_the_function_of_every_route_and_nothing_else(cfn):
    permissions = [
        r["Properties"] for r in of_type(cfn, "AWS::Lambda::Permission").values()
        if r["Properties"]["Principal"] == "apigateway.amazonaws.com"
    ]
    granted = {}
    for permission in permissions:
        source = permission["SourceArn"]["Fn::Sub"]
        prefix = f"arn:aws:execute-api:{REGION}:{ACCOUNT}:${{GatewayApi}}/*/"
        assert source.startswith(prefix), source
        granted[source[len(prefix):]] = permission["FunctionName"]["Ref"]
    for (method, path), function in ROUTES.items():
        arn_path = f"{method.upper()}{re.sub(r'{[^}]+}', '*', path)}"
        assert granted.get(arn_path) == function, arn_path
    assert len(granted) == len(ROUTES)


def test_one_stage_named_prod_and_no_extra_stage(cfn):
    stages = of_type(cfn, "AWS::ApiGateway::Stage")
    assert [stage["Properties"]["StageName"] for stage in stages.values()] == ["prod"]
    for deployment in of_type(cfn, "AWS::ApiGateway::Deployment").values():
        assert "StageName" not in deployment["Properties"]  # a deployment's StageName makes a stage "Stage"
    assert cfn["Outputs"]["ApiUrl"]["Value"]["Fn::Sub"].endswith("/prod/v1")


def test_a_deploy_that_changes_only_a_parameter_puts_the_new_integrations_on_the_stage(monkeypatch):
    """A stage serves the deployment it points at, a snapshot of the API: a deploy that switches
    InvokeMode changes the integrations (and the functions' handlers) only in intrinsic
    functions, which leave the API's text alone. Unless that deploy makes a new deployment,
    the stage keeps sending requests to the old integrations of the new functions."""
    import samtranslator.model.apigateway as apigateway

    def stage_deployment(mode: dict[str, Any], now: float) -> str:
        monkeypatch.setattr(apigateway.time, "time", lambda: now)
        cfn = translate(mode)
        (stage,) = of_type(cfn, "AWS::ApiGateway::Stage").values()
        return stage["Properties"]["DeploymentId"]["Ref"]

    first = stage_deployment({"InvokeMode": "streaming"}, 1_800_000_000)
    second = stage_deployment({"InvokeMode": "buffered"}, 1_800_000_600)
    assert first != second


# -- the front door ---------------------------------------------------------------------------


def test_every_function_has_reserved_concurrency_leaving_the_account_its_unreserved_100(cfn):
    functions = of_type(cfn, "AWS::Lambda::Function")
    assert set(functions) == set(FUNCTIONS)
    reserved = {name: f["Properties"].get("ReservedConcurrentExecutions") for name, f in functions.items()}
    assert all(isinstance(value, int) and value >= 1 for value in reserved.values()), reserved
    assert sum(reserved.values()) <= 1000 - 100  # Lambda keeps 100 of the default 1 000 unreserved
    assert reserved["ChatCompletionsFunction"] >= reserved["ModelsFunction"]


def test_reserved_concurrency_follows_its_parameters():
    shares = {function: 3 + index for index, function in enumerate(FUNCTIONS)}
    cfn = translate({f"{function[:-len('Function')]}Concurrency": share for function, share in shares.items()})
    reserved = {name: f["Properties"]["ReservedConcurrentExecutions"]
                for name, f in of_type(cfn, "AWS::Lambda::Function").items()}
    assert reserved == shares


def test_the_stage_throttles_and_writes_json_access_logs(cfn):
    (stage,) = of_type(cfn, "AWS::ApiGateway::Stage").values()
    (settings,) = stage["Properties"]["MethodSettings"]
    assert (settings["ResourcePath"], settings["HttpMethod"]) == ("/*", "*")
    assert settings["ThrottlingRateLimit"] == 500 and settings["ThrottlingBurstLimit"] == 1000
    access = stage["Properties"]["AccessLogSetting"]
    group = cfn["Resources"][access["DestinationArn"]["Fn::GetAtt"][0]]
    assert group["Type"] == "AWS::Logs::LogGroup" and group["Properties"]["RetentionInDays"] == 30
    line = json.loads(_render(access["Format"]))
    assert {"requestId", "lambdaRequestId", "method", "path", "status", "latencyMs", "error"} <= set(line)
    assert "$context.requestId" in access["Format"]  # API Gateway refuses a format without it


def test_access_logs_need_the_account_role_the_stack_sets_unless_told_it_exists(cfn, mode):
    account = of_type(cfn, "AWS::ApiGateway::Account")
    if mode.get("SetApiGatewayLogsRole") == "false":
        assert account == {}
    else:
        (setting,) = account.values()
        role = cfn["Resources"][setting["Properties"]["CloudWatchRoleArn"]["Fn::GetAtt"][0]]
        assert role["Properties"]["ManagedPolicyArns"] == [
            "arn:aws:iam::aws:policy/service-role/AmazonAPIGatewayPushToCloudWatchLogs"]
        assert role["DeletionPolicy"] == setting["DeletionPolicy"] == "Retain"  # other APIs may log with it
        # the API (so its stage) is created once the account names the role
        (api_name,) = of_type(cfn, "AWS::ApiGateway::RestApi")
        handle = cfn["Resources"][cfn["Resources"][api_name]["DependsOn"]]
        assert handle["Metadata"]["AccountSetting"] == {"Ref": next(iter(account))}


def _render(template: str) -> str:
    """A gateway response or access log template as API Gateway fills it in."""
    text = template.replace("$context.error.messageString", json.dumps('Say "hi"'))
    return re.sub(r"\$context\.[A-Za-z.]+", "value", text)


@pytest.mark.parametrize(
    "response,status,error_type,code",
    [
        ("MISSING_AUTHENTICATION_TOKEN", "404", "invalid_request_error", "unknown_url"),  # a route it lacks
        ("THROTTLED", "429", "rate_limit_error", "rate_limit_exceeded"),
        ("REQUEST_TOO_LARGE", "413", "invalid_request_error", "request_too_large"),
        # Lambda's throttle at a function's reserved concurrency reaches API Gateway as an
        # integration failure: a client must be told to retry, not that the gateway is broken
        ("INTEGRATION_FAILURE", "503", "service_unavailable", "function_unavailable"),
        ("INTEGRATION_TIMEOUT", "504", "server_error", "gateway_timeout"),
        ("DEFAULT_4XX", None, "invalid_request_error", None),
        ("DEFAULT_5XX", None, "server_error", "internal_error"),
    ],
)
def test_api_gateways_own_errors_answer_in_the_contracts_error_shape(response, status, error_type, code):
    for mode in ({"InvokeMode": "streaming"}, {"InvokeMode": "buffered"}):
        responses = rest_api_body(deployed(mode))["x-amazon-apigateway-gateway-responses"]
        answer = responses[response]
        assert answer.get("statusCode") == status
        body = json.loads(_render(answer["responseTemplates"]["application/json"]))
        assert list(body) == ["error"]
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (error_type, code, None)
        assert body["error"]["message"]


def test_a_429_of_api_gateways_own_carries_no_rate_limit_headers():
    """§8: a 429 carries no rate-limit headers, the stage's throttling included (the SDKs
    back off on the status alone)."""
    for mode in ({"InvokeMode": "streaming"}, {"InvokeMode": "buffered"}):
        responses = rest_api_body(deployed(mode))["x-amazon-apigateway-gateway-responses"]
        for name, answer in responses.items():
            if str(answer.get("statusCode")) == "429":
                headers = {header.rsplit(".", 1)[-1].lower() for header in answer.get("responseParameters", {})}
                assert not {h for h in headers if h == "retry-after" or "ratelimit" in h}, (name, headers)


def test_function_urls_only_when_asked_for_and_public_only_when_said(cfn, mode):
    urls = of_type(cfn, "AWS::Lambda::Url")
    public = [r["Properties"] for r in of_type(cfn, "AWS::Lambda::Permission").values()
              if r["Properties"]["Principal"] == "*"]
    outputs = {name for name in cfn["Outputs"] if name.endswith("FunctionUrl")}
    if mode["FunctionUrls"] == "none":
        assert urls == {} and public == [] and outputs == set()
        return
    assert {url["Properties"]["TargetFunctionArn"]["Ref"] for url in urls.values()} == set(STREAMING_FUNCTIONS)
    assert outputs == {f"{function}Url" for function in STREAMING_FUNCTIONS}
    for url in urls.values():
        assert url["Properties"]["InvokeMode"] == ("RESPONSE_STREAM" if streaming(mode) else "BUFFERED")
        assert url["Properties"]["AuthType"] == ("NONE" if mode["FunctionUrls"] == "public" else "AWS_IAM")
    if mode["FunctionUrls"] == "iam":
        assert public == []
    else:
        granted = {(p["FunctionName"]["Ref"], p["Action"]) for p in public}
        assert granted == {(f, action) for f in STREAMING_FUNCTIONS
                           for action in ("lambda:InvokeFunctionUrl", "lambda:InvokeFunction")}


def test_guided_deploy_finds_no_route_without_authorization_to_ask_about():
    """`sam deploy --guided` asks about every Api event and public Function URL, and its
    default answer aborts: the template has neither (routes live in the OpenAPI body)."""
    for name, resource in load_template()["Resources"].items():
        if resource["Type"] == "AWS::Serverless::Function":
            assert "Events" not in resource["Properties"], name
            assert "FunctionUrlConfig" not in resource["Properties"], name


# -- live data and secrets --------------------------------------------------------------------


def test_no_stack_resource_owns_a_live_value(cfn):
    """An update or rollback resets whatever the stack owns: it owns no parameter, so a
    catalog, switch or key that operators changed stays as they left it."""
    assert of_type(cfn, "AWS::SSM::Parameter") == {}
    names = {f"/{STACK}/catalog", f"/{STACK}/maintenance", f"/{STACK}/upstream-api-key"}
    for name, resource in cfn["Resources"].items():
        if resource["Type"].startswith(("AWS::SSM::", "AWS::SecretsManager::", "Custom::", "AWS::CloudFormation::Custom")):
            raise AssertionError(f"{name} ({resource['Type']}) would own live data")
        assert resource.get("Properties", {}).get("Name") not in names, name
    for function in FUNCTIONS:
        assert env(cfn, function)["KILN_CATALOG_PARAMETER"] == f"/{STACK}/catalog"
        assert env(cfn, function)["KILN_MAINTENANCE_PARAMETER"] == f"/{STACK}/maintenance"
    assert cfn["Outputs"]["CatalogParameterName"]["Value"] == f"/{STACK}/catalog"
    assert cfn["Outputs"]["UpstreamApiKeyParameterName"]["Value"] == f"/{STACK}/upstream-api-key"


def test_tables_are_retained_on_delete_and_on_replacement(cfn):
    tables = of_type(cfn, "AWS::DynamoDB::Table")
    assert set(tables) == {"KeysTable", "OrgsTable", "UsageTable"}
    for name, table in tables.items():
        assert table["DeletionPolicy"] == "Retain", name
        assert table["UpdateReplacePolicy"] == "Retain", name
        assert table["Properties"]["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}


SECRET_WORDS = re.compile(r"API_KEY|SECRET|TOKEN|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)


def test_no_secret_in_any_functions_configuration(cfn):
    """Anyone allowed lambda:GetFunctionConfiguration reads a function's environment."""
    template = load_template()
    assert not [name for name, spec in template["Parameters"].items() if spec.get("NoEcho")]
    for function in FUNCTIONS:
        for name, value in env(cfn, function).items():
            if SECRET_WORDS.search(name):
                # only the name of the SecureString and its cache time, never a key
                assert name in ("KILN_UPSTREAM_API_KEY_PARAMETER", "KILN_UPSTREAM_API_KEY_CACHE_SECONDS"), name
            assert not str(value).startswith(("sk-", "Bearer")), name
        assert "KILN_UPSTREAM_API_KEY" not in env(cfn, function)
    for endpoint in ENDPOINTS:  # the key's name only where model servers are called
        variables = env(cfn, endpoint.resource)
        if endpoint.api is not None:
            assert variables["KILN_UPSTREAM_API_KEY_PARAMETER"] == f"/{STACK}/upstream-api-key"
        else:
            assert "KILN_UPSTREAM_API_KEY_PARAMETER" not in variables


# -- IAM, network ---------------------------------------------------------------------------------


def statements(cfn, role: str) -> list[dict[str, Any]]:
    found = []
    for policy in cfn["Resources"][role]["Properties"].get("Policies", []):
        found += policy["PolicyDocument"]["Statement"]
    return found


def granted(cfn, role: str, action: str) -> list[Any]:
    resources = []
    for statement in statements(cfn, role):
        if action in statement["Action"]:
            resources += statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
    return resources


ROLES = {f"{function[:-len('Function')]}Role": function for function in FUNCTIONS}
# the roles of the model endpoints: they admit, bill and call model servers
MODEL_ROLES = tuple(f"{e.resource[:-len('Function')]}Role" for e in ENDPOINTS if e.api is not None)


def test_every_function_has_its_own_role_and_no_wildcard(cfn):
    for role, function in ROLES.items():
        assert cfn["Resources"][function]["Properties"]["Role"] == {"Fn::GetAtt": [role, "Arn"]}
        for statement in statements(cfn, role):
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            assert all("*" not in action for action in actions), (role, statement["Sid"])
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            assert all(resource != "*" for resource in resources), (role, statement["Sid"])


def test_each_role_reads_only_the_parameters_its_function_uses(cfn):
    read = {role: sorted(granted(cfn, role, "ssm:GetParameter")) for role in ROLES}
    assert {"ChatCompletionsRole", "CompletionsRole"} <= set(MODEL_ROLES)
    for role in MODEL_ROLES:
        assert read[role] == sorted(PARAMETER_ARN.format(name) for name in ("maintenance", "catalog", "upstream-api-key"))
    assert read["ModelsRole"] == sorted(PARAMETER_ARN.format(name) for name in ("maintenance", "catalog"))
    # the generations function checks a key's allowlist against the catalog (POST/PATCH /v1/keys)
    assert read["GenerationsRole"] == sorted(PARAMETER_ARN.format(name) for name in ("maintenance", "catalog"))


def test_each_role_grants_only_what_its_function_calls(cfn):
    def actions(role: str) -> set[str]:
        return {action for statement in statements(cfn, role) for action in statement["Action"]}

    gateway = {"logs:CreateLogStream", "logs:PutLogEvents", "dynamodb:GetItem", "dynamodb:UpdateItem",
               "dynamodb:PutItem", "ssm:GetParameter"}
    for role in MODEL_ROLES:
        assert actions(role) - {"kms:Decrypt"} == gateway, role
        # the usage table is updated only in the keys' tallies (kiln.store.tally), never an event
        (tally,) = [statement for statement in statements(cfn, role) if statement["Resource"] == {
            "Fn::GetAtt": ["UsageTable", "Arn"]} and "dynamodb:UpdateItem" in statement["Action"]]
        assert tally["Action"] == ["dynamodb:UpdateItem"], role
        assert tally["Condition"] == {"ForAllValues:StringLike": {"dynamodb:LeadingKeys": ["tally:*"]}}, role
    # the models and generations functions neither admit nor bill: they write only keys (their
    # last use; the generations function also issues, changes and revokes them, contract §10)
    assert actions("ModelsRole") == gateway - {"dynamodb:PutItem"}
    assert actions("GenerationsRole") == gateway | {"dynamodb:Query", "dynamodb:ConditionCheckItem",
                                                    "dynamodb:BatchGetItem"}
    # keys' spend is read from their tallies (kiln.store.tally), beside the usage events
    assert granted(cfn, "GenerationsRole", "dynamodb:BatchGetItem") == [{"Fn::GetAtt": ["UsageTable", "Arn"]}]
    # a key item checked (never written) where what requests in flight left for it is cleared
    assert granted(cfn, "GenerationsRole", "dynamodb:ConditionCheckItem") == [{"Fn::GetAtt": ["KeysTable", "Arn"]}]
    assert granted(cfn, "ModelsRole", "dynamodb:UpdateItem") == [{"Fn::GetAtt": ["KeysTable", "Arn"]}]
    assert granted(cfn, "GenerationsRole", "dynamodb:UpdateItem") == [
        {"Fn::GetAtt": ["KeysTable", "Arn"]}, {"Fn::GetAtt": ["OrgsTable", "Arn"]}]
    # on the org item, only the keys' spend figures and their count: never credits, limits or leases
    (figures,) = [statement for statement in statements(cfn, "GenerationsRole")
                  if statement["Resource"] == {"Fn::GetAtt": ["OrgsTable", "Arn"]} and "dynamodb:UpdateItem" in statement["Action"]]
    assert figures["Condition"] == {"ForAllValues:StringLike": {"dynamodb:Attributes": ["org_id", "key_spend:*",
                                                                                          "key_period:*", "limited_keys"]},
                                    "StringEqualsIfExists": {"dynamodb:ReturnValues": ["NONE"]}}
    assert granted(cfn, "GenerationsRole", "dynamodb:PutItem") == [{"Fn::GetAtt": ["KeysTable", "Arn"]}]
    # it reads usage and finds keys through the indexes only: never a scan, never a whole table
    assert granted(cfn, "GenerationsRole", "dynamodb:Query") == [
        {"Fn::Sub": "${KeysTable.Arn}/index/by_key_id"}, {"Fn::Sub": "${KeysTable.Arn}/index/by_org"},
        {"Fn::Sub": "${UsageTable.Arn}/index/by_org_time"}]
    assert sorted(map(json.dumps, granted(cfn, "GenerationsRole", "dynamodb:GetItem"))) == sorted(map(json.dumps, [
        {"Fn::GetAtt": ["KeysTable", "Arn"]}, {"Fn::GetAtt": ["OrgsTable", "Arn"]}, {"Fn::GetAtt": ["UsageTable", "Arn"]}]))


def test_kms_decrypt_only_for_a_customer_managed_key_and_only_through_ssm(cfn, mode):
    for role in ROLES:
        decrypt = [s for s in statements(cfn, role) if "kms:Decrypt" in s["Action"]]
        if "UpstreamApiKeyKmsKeyArn" in mode and role in MODEL_ROLES:
            (statement,) = decrypt
            assert statement["Resource"] == KMS_KEY
            assert statement["Condition"] == {"StringEquals": {"kms:ViaService": f"ssm.{REGION}.amazonaws.com"}}
        else:
            assert decrypt == []  # the AWS managed aws/ssm key needs no grant


def test_functions_join_the_vpc_only_when_subnets_are_given(cfn, mode):
    for role, function in ROLES.items():
        props = cfn["Resources"][function]["Properties"]
        managed = cfn["Resources"][role]["Properties"].get("ManagedPolicyArns", [])
        if "SubnetIds" in mode:
            assert props["VpcConfig"] == {"SubnetIds": ["subnet-0a1b2c3d", "subnet-4e5f6a7b"],
                                          "SecurityGroupIds": ["sg-0123456789abcdef0"]}
            assert managed == ["arn:aws:iam::aws:policy/service-role/AWSLambdaVPCAccessExecutionRole"]
        else:
            assert "VpcConfig" not in props
            assert managed == []


# -- the rest -------------------------------------------------------------------------------------


def test_runtime_architecture_memory_and_layer(cfn):
    for function in FUNCTIONS:
        props = cfn["Resources"][function]["Properties"]
        assert props["Runtime"] == "python3.13"
        assert props["Architectures"] == ["arm64"]
        assert 256 <= props["MemorySize"] <= 3008  # below 256 MB, TTFB p99 and starts fail the bench's rule
        layers = of_type(cfn, "AWS::Lambda::LayerVersion")
        assert any(layer == {"Ref": name} for layer in props["Layers"] for name in layers)


def test_parameter_caches_are_sized_for_ssm_at_1000_environments(cfn):
    """docs/deploy.md, "SSM reads": every busy environment reading every parameter at the
    deployed cache times stays under SSM's default 40 TPS at 1 000 environments."""
    chat = env(cfn, "ChatCompletionsFunction")
    per_environment = sum(1 / float(chat[name]) for name in (
        "KILN_MAINTENANCE_CACHE_SECONDS", "KILN_CATALOG_CACHE_SECONDS", "KILN_UPSTREAM_API_KEY_CACHE_SECONDS"))
    jitter = 1 / 0.9  # refreshes fall due at 80-100% of the cache time: 90% on average
    assert 1000 * per_environment * jitter < 40
    assert "KILN_UPSTREAM_API_KEY_CACHE_SECONDS" not in env(cfn, "ModelsFunction")


def test_logs_alarms_dashboard_and_outputs(cfn):
    resources = cfn["Resources"]
    for function in FUNCTIONS:
        group = resources[function]["Properties"]["LoggingConfig"]["LogGroup"]["Ref"]
        assert resources[group]["Properties"]["RetentionInDays"] == 30
    alarms = set(of_type(cfn, "AWS::CloudWatch::Alarm"))
    assert alarms == {"Gateway5xxRateAlarm", "UpstreamErrorsAlarm", "LambdaThrottlesAlarm", "DurationNearTimeoutAlarm",
                      "RateLimitSurgeAlarm", "ApiGateway5xxRateAlarm", "FunctionErrorsAlarm"}
    assert "Dashboard" in resources

    def watched(alarm: str, metric: str) -> set:
        return {query["MetricStat"]["Metric"]["Dimensions"][0]["Value"]["Ref"]
                for query in resources[alarm]["Properties"]["Metrics"]
                if "MetricStat" in query and query["MetricStat"]["Metric"]["MetricName"] == metric}

    assert watched("LambdaThrottlesAlarm", "Throttles") == set(FUNCTIONS)
    assert watched("FunctionErrorsAlarm", "Errors") == set(FUNCTIONS)
    assert watched("DurationNearTimeoutAlarm", "Duration") == set(STREAMING_FUNCTIONS)
    for name in ("ApiUrl", "KeysTableName", "OrgsTableName", "UsageTableName", "MaintenanceParameterName",
                 "CatalogParameterName", "UpstreamApiKeyParameterName", "ApiAccessLogGroupName", "Region"):
        assert name in cfn["Outputs"], name


def test_usage_events_expire_through_ttl(cfn):
    ttl = cfn["Resources"]["UsageTable"]["Properties"]["TimeToLiveSpecification"]
    assert ttl == {"AttributeName": "expires_at", "Enabled": True}
    assert env(cfn, "ChatCompletionsFunction")["KILN_USAGE_RETENTION_DAYS"] == 400
    # `kiln admin --stack` reads the same parameter for the events it writes (replay-usage)
    from kiln_ops.stack import PARAMETERS
    assert set(PARAMETERS) <= set(cfn["Parameters"])
    for table in ("Keys", "Orgs", "Usage"):
        assert env(cfn, "ModelsFunction")[f"KILN_{table.upper()}_TABLE"] == {"Ref": f"{table}Table"}


def test_alarms_watch_metrics_the_gateway_emits(cfn, request):
    """The custom alarms read metric names that kiln.observability really publishes: the EMF
    documents of a failed request (5xx, 429, an upstream failure) name every one of them."""
    import io
    import json
    import logging

    from kiln import observability

    # an Observer takes over its service's logger, which the tests' stacks log through: give it back
    logger = logging.getLogger("kiln")
    state = {name: list(value) if isinstance(value, list) else value for name, value in vars(logger).items()}
    request.addfinalizer(lambda: (vars(logger).clear(), vars(logger).update(state)))
    stream = io.StringIO()
    observer = observability.Observer(stream=stream, metrics_enabled=True)
    for status, code in ((502, "upstream_error"), (429, "rate_limited")):
        record = observability.RequestRecord("POST", "/v1/chat/completions")
        record.status, record.endpoint, record.error_code, record.backend_failures = status, "chat.completions", code, 1
        observer.emit(record)
    documents = [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith('{"_aws"')]
    emitted = {metric["Name"] for document in documents for metric in document["_aws"]["CloudWatchMetrics"][0]["Metrics"]}
    resources = cfn["Resources"]
    names = [resources[alarm]["Properties"]["MetricName"] for alarm in ("UpstreamErrorsAlarm", "RateLimitSurgeAlarm")]
    for query in resources["Gateway5xxRateAlarm"]["Properties"]["Metrics"]:
        if "MetricStat" in query:
            names.append(query["MetricStat"]["Metric"]["MetricName"])
    assert names and set(names) <= emitted, set(names) - emitted


def custom_metrics(cfn) -> set[tuple]:
    """(namespace, metric, dimensions) of every metric an alarm or the dashboard reads that the
    gateway itself publishes, and what its functions publish under."""
    watched = set()
    for alarm in of_type(cfn, "AWS::CloudWatch::Alarm").values():
        props = alarm["Properties"]
        metrics = [query["MetricStat"]["Metric"] for query in props.get("Metrics", []) if "MetricStat" in query]
        if "MetricName" in props:
            metrics.append(props)
        for metric in metrics:
            if not metric["Namespace"].startswith("AWS/"):
                dims = tuple(sorted((d["Name"], d["Value"]) for d in metric["Dimensions"]))
                watched.add((metric["Namespace"], metric["MetricName"], dims))
    body = json.loads(cfn["Resources"]["Dashboard"]["Properties"]["DashboardBody"])
    for widget in body["widgets"]:
        first = widget["properties"]["metrics"][0]
        watched.add((first[0], first[1], ((first[2], first[3]),)))
    return watched


def test_two_stacks_in_one_account_alarm_on_their_own_traffic():
    """CloudWatch adds up every data point of a namespace, metric and dimensions, whichever
    stack wrote it: a staging stack beside production must not page production, nor dilute its
    error rate. Each stack's functions publish under its own name, and its alarms and dashboard
    read that name and no other, the REST API's metrics included. Nor do two stacks publish
    versions of one layer."""
    seen = {}
    for stack in ("kiln-prod", "kiln-staging"):
        cfn = translate({"AWS::StackName": stack})
        namespaces = {env(cfn, function)["POWERTOOLS_METRICS_NAMESPACE"] for function in FUNCTIONS}
        assert namespaces == {f"Kiln/{stack}"}
        # the service stays the one the gateway's module loggers (kiln.*) are children of
        assert {env(cfn, function)["POWERTOOLS_SERVICE_NAME"] for function in FUNCTIONS} == {"kiln"}
        watched = custom_metrics(cfn)
        assert watched and {namespace for namespace, _, _ in watched} == namespaces
        assert {dict(dims)["service"] for _, _, dims in watched} == {"kiln"}
        (api,) = of_type(cfn, "AWS::ApiGateway::RestApi").values()
        assert api["Properties"]["Name"] == api["Properties"]["Body"]["info"]["title"] == stack
        # and each publishes its own layer, not versions of one both share
        assert {layer["Properties"]["LayerName"] for layer in of_type(cfn, "AWS::Lambda::LayerVersion").values()} \
            == {f"{stack}-gateway"}
        seen[stack] = watched
    assert not seen["kiln-prod"] & seen["kiln-staging"]


def test_failures_no_request_of_the_gateway_sees_have_alarms(cfn):
    """A function that fails to start, runs out of memory or time, or is throttled never reaches
    the gateway's own code, so it publishes no `Errors5xx`: API Gateway's 5xx rate and Lambda's
    own error count are watched too."""
    resources = cfn["Resources"]
    (api,) = of_type(cfn, "AWS::ApiGateway::RestApi").values()
    api_alarm = resources["ApiGateway5xxRateAlarm"]["Properties"]
    assert (api_alarm["Namespace"], api_alarm["MetricName"], api_alarm["Statistic"]) == ("AWS/ApiGateway", "5XXError",
                                                                                         "Average")
    assert {d["Name"]: d["Value"] for d in api_alarm["Dimensions"]} == {"ApiName": api["Properties"]["Name"],
                                                                          "Stage": "prod"}
    assert 0 < api_alarm["Threshold"] < 1  # the average of 0s and 1s: a share of the requests
    errors = resources["FunctionErrorsAlarm"]["Properties"]
    assert errors["Threshold"] == 1 and errors["ComparisonOperator"] == "GreaterThanOrEqualToThreshold"
    (total,) = [query for query in errors["Metrics"] if query.get("ReturnData")]
    assert total["Expression"].startswith("SUM(")


def test_the_5xx_rate_is_a_documented_expression_that_divides_by_no_zero(cfn):
    """A metric-math expression CloudWatch would refuse fails the deploy: the rate uses IF, not
    a scalar inside a time-series array."""
    (rate,) = [q for q in cfn["Resources"]["Gateway5xxRateAlarm"]["Properties"]["Metrics"] if q.get("ReturnData")]
    assert rate["Expression"] == "IF(requests > 0, 100 * errors / requests, 0)"


def test_sam_deploy_guided_deploys_when_every_prompt_is_answered_with_enter():
    """samconfig.toml gives --guided its defaults: each one must lead to a deployed stack."""
    import tomllib

    from kiln_ops.template import repo_root

    config = tomllib.loads((repo_root() / "samconfig.toml").read_text())["default"]
    deploy = config["deploy"]["parameters"]
    assert config["global"]["parameters"]["stack_name"] == STACK
    # "Deploy this changeset? [y/N]" follows a confirmed change set, and Enter there aborts
    assert deploy["confirm_changeset"] is False
    assert deploy["resolve_s3"] is True  # SAM's managed bucket: nothing to create by hand
    assert deploy["disable_rollback"] is False
    # the roles have no fixed names, so CAPABILITY_IAM (the guided default) is enough
    assert deploy["capabilities"] == "CAPABILITY_IAM"
    for name, resource in of_type(deployed({}), "AWS::IAM::Role").items():
        assert "RoleName" not in resource["Properties"], name
    # a parameter without a default (or NoEcho) makes --guided insist on an answer
    for name, spec in load_template()["Parameters"].items():
        assert "Default" in spec and not spec.get("NoEcho"), name


# The IAM action each DynamoDB call needs (a transaction: each of its items, by its kind).
CALL_ACTIONS = {"GetItem": "dynamodb:GetItem", "PutItem": "dynamodb:PutItem", "UpdateItem": "dynamodb:UpdateItem",
                "DeleteItem": "dynamodb:DeleteItem", "Query": "dynamodb:Query", "Scan": "dynamodb:Scan",
                "BatchGetItem": "dynamodb:BatchGetItem"}
ITEM_ACTIONS = {"Get": "dynamodb:GetItem", "Put": "dynamodb:PutItem", "Update": "dynamodb:UpdateItem",
                "Delete": "dynamodb:DeleteItem", "ConditionCheck": "dynamodb:ConditionCheckItem"}


def needed(settings, calls: list[tuple[str, dict]]) -> set[tuple[str, str]]:
    """(action, resource as template.yaml writes it) of every call."""
    tables = {settings.keys_table: "KeysTable", settings.orgs_table: "OrgsTable", settings.usage_table: "UsageTable"}

    def resource(payload: dict) -> str:
        table = tables[payload["TableName"]]
        if payload.get("IndexName"):
            return json.dumps({"Fn::Sub": f"${{{table}.Arn}}/index/{payload['IndexName']}"})
        return json.dumps({"Fn::GetAtt": [table, "Arn"]})

    found = set()
    for operation, payload in calls:
        if operation == "BatchGetItem":
            found.update((CALL_ACTIONS[operation], resource({"TableName": table})) for table in payload["RequestItems"])
            continue
        if "TableName" not in payload and "TransactItems" not in payload:
            continue  # not DynamoDB's (SSM's reads are checked above)
        if operation in ("TransactWriteItems", "TransactGetItems"):
            for item in payload["TransactItems"]:
                ((kind, inner),) = item.items()
                found.add((ITEM_ACTIONS[kind], resource(inner)))
        else:
            found.add((CALL_ACTIONS[operation], resource(payload)))
    return found


def test_every_storage_call_of_self_service_is_granted_to_its_function(stack):
    """The embedded AWS enforces no IAM: each DynamoDB call the generations function makes for
    the self-service routes, down to each item of a transaction, is checked against its role."""
    from kiln.responses import GENERATION_HEADER
    from kiln.store import UsageEvent
    from kiln.store.clock import iso_ms
    from kiln.store.keys import create_key
    from kiln.store.keyspend import KeyLimits

    org_id, _ = stack.org(credits="1000")
    admin = create_key(stack.tables, org_id, role="management", label="console").secret

    calls: list[tuple[str, dict]] = []

    def call(method: str, path: str, key: str, body=None):
        mark = len(stack.faults.calls)
        answer = stack.http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
        calls.extend(stack.faults.calls[mark:])
        assert answer.status_code < 300, (method, path, answer.text)
        return answer.json()

    key = call("POST", "/v1/keys", admin, {"spend_limit": 5})
    chat = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    assert stack.post("/v1/chat/completions", chat, key["secret"]).status_code == 200
    # a request in flight across the revocation leaves a figure that the next limit set clears
    lease = stack.ledger.admit(org_id=org_id, key_id=key["id"], model="qwen3-32b", endpoint="chat.completions",
                               streamed=False, limits=KeyLimits(None, Decimal(5), "total"))
    call("DELETE", f"/v1/keys/{key['id']}", admin)
    stack.ledger.settle(lease, UsageEvent(gen_id=lease.gen_id, org_id=org_id, created_at=iso_ms(lease.started),
                                          key_id=key["id"], model="qwen3-32b", endpoint="chat.completions",
                                          streamed=False, status="success", cost=Decimal("0.1")))
    other = call("POST", "/v1/keys", admin, {"label": "job", "models": ["qwen3-32b"]})
    call("PATCH", f"/v1/keys/{other['id']}", admin, {"spend_limit": "2", "spend_period": "day"})
    call("PATCH", f"/v1/keys/{other['id']}", admin, {"spend_period": "week", "concurrency": 2, "label": "batch"})
    call("PATCH", f"/v1/keys/{other['id']}", admin, {"spend_limit": None})
    for path in ("/v1/keys", f"/v1/keys/{other['id']}", "/v1/credits", "/v1/usage?group_by=key"):
        call("GET", path, admin)
    call("GET", "/v1/key", other["secret"])
    gen_id = stack.post("/v1/chat/completions", chat, other["secret"]).headers[GENERATION_HEADER]
    call("GET", f"/v1/generations/{gen_id}", other["secret"])
    call("DELETE", f"/v1/keys/{other['id']}", admin)

    assert any(kind == "dynamodb:ConditionCheckItem" for kind, _ in needed(stack.settings, calls))  # the clearing ran
    cfn = deployed(MODES[0])
    grants = {(action, json.dumps(resource)) for action in set(CALL_ACTIONS.values()) | set(ITEM_ACTIONS.values())
              for resource in granted(cfn, "GenerationsRole", action)}
    assert needed(stack.settings, calls) - grants == set()


def test_every_storage_call_of_a_model_request_is_granted_to_its_function(stack_factory):
    """As above, for the model endpoints: admissions within a key's limits, a reclaim of a dead
    request's lease by the next admission, settles of buffered and streamed requests, and the
    late settle of a request whose lease was reclaimed while it ran (it reads the abandoned
    event it replaces)."""
    from kiln.store import UsageEvent
    from kiln.store.clock import iso_ms
    from kiln.store.keys import create_key
    from support import StorageFaults, SyncLedger

    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1000")
    secret = create_key(stack.tables, org_id, label="job").secret
    limited = stack.key(org_id, spend_limit=Decimal(5), spend_period="day", concurrency=2)
    stack.ledger.admit(org_id=org_id, key_id="key_0123456789abcdef", model="qwen3-32b",
                       endpoint="chat.completions", streamed=False)  # never settled: reclaimed below
    late = stack.ledger.admit(org_id=org_id, key_id="key_0123456789abcdef", model="qwen3-32b",
                              endpoint="chat.completions", streamed=True)  # reclaimed, then settled
    time.sleep(0.4)
    mark = len(stack.faults.calls)
    chat = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    for key, body in ((secret, chat), (limited, chat), (secret, {**chat, "stream": True}),
                      (limited, {**chat, "stream": True, "stream_options": {"include_usage": True}})):
        response = stack.post("/v1/chat/completions", body, key)
        assert response.status_code == 200, response.text
    deadline = time.monotonic() + 5  # the reclaim runs beside the admission that found the lease
    while [event.status for event in stack.events(org_id)].count("abandoned") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [event.status for event in stack.events(org_id)].count("abandoned") == 2
    settling = StorageFaults()
    event = UsageEvent(gen_id=late.gen_id, org_id=org_id, created_at=iso_ms(late.started), key_id=late.key_id,
                       model=late.model, endpoint=late.endpoint, streamed=True, status="success",
                       cost=Decimal("0.25"), prompt_tokens=3, completion_tokens=5)
    assert SyncLedger(stack.settings, settling).settle(late, event) == "replaced_abandoned"
    calls = stack.faults.calls[mark:] + settling.calls
    cfn = deployed(MODES[0])
    for role in MODEL_ROLES:
        grants = {(action, json.dumps(resource)) for action in set(CALL_ACTIONS.values()) | set(ITEM_ACTIONS.values())
                  for resource in granted(cfn, role, action)}
        assert needed(stack.settings, calls) - grants == set(), role
    # and the condition of the usage table's UpdateItem: only tallies (dynamodb:LeadingKeys)
    updated = [inner["Key"]["gen_id"]["S"] for operation, payload in calls
               for kind, inner in ([next(iter(item.items())) for item in payload["TransactItems"]]
                                   if operation == "TransactWriteItems" else [(operation, payload)])
               if kind in ("Update", "UpdateItem") and inner.get("TableName") == stack.settings.usage_table]
    assert updated and all(key.startswith("tally:") for key in updated), updated


def _event_for(route, key: str) -> dict:
    """A REST event (API Gateway's v1 payload) for `route`, as tests/events' chat request is."""
    from pathlib import Path

    event = json.loads((Path(__file__).resolve().parents[1] / "events" / "rest-chat-completions.json").read_text())
    event["headers"]["Authorization"] = f"Bearer {key}"
    event["multiValueHeaders"]["Authorization"] = [f"Bearer {key}"]
    event.update(resource=route.path, path=route.path, httpMethod=route.method)
    event["requestContext"].update(resourcePath=route.path, httpMethod=route.method, path=f"/v1{route.path}")
    if route.method == "GET":
        event["body"] = None
    return event


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=lambda endpoint: endpoint.function)
def test_a_disabled_orgs_dead_lease_costs_no_call_its_functions_role_refuses(stack_factory, monkeypatch, endpoint):
    """A disabled org is answered 403 by every function's key lookup, and a dead lease its item
    holds is reclaimed off the request's path. That reclaim writes the org, the abandoned event
    and the key's tally: the models and generations functions' roles refuse those writes, and on
    AWS the reclaim failed there on every lookup (the embedded AWS enforces no IAM). Each
    function, as Lambda runs it, makes only the calls its own role grants."""
    import asyncio
    import importlib

    import kiln.gateway
    from kiln.aws import AwsClient
    from kiln.store.orgs import set_status
    from support import LAMBDA_CONTEXT, FaultInjectingHttp, StorageFaults

    stack = stack_factory(lease_ttl_seconds=0.5, lease_renew_seconds=0.2)
    org_id, secret = stack.org(credits="1", concurrency=4)
    dead = stack.ledger.admit(org_id=org_id, key_id="key_0123456789abcdef", model="qwen3-32b",
                              endpoint="completions", streamed=False)
    stack.ledger.renew(dead, (1, 2, Decimal("0.5")))
    set_status(stack.tables, org_id, "disabled")
    time.sleep(0.6)
    for name, value in stack.settings.to_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("POWERTOOLS_METRICS_DISABLED", "true")
    recorded = StorageFaults()
    monkeypatch.setattr(kiln.gateway, "AwsClient",
                        lambda **given: AwsClient(**{**given, "http": FaultInjectingHttp(recorded)}))
    module = importlib.import_module(f"kiln_functions.{endpoint.function}.app")
    module.app.state._state.pop("gateway", None)
    try:
        route = next(route for route in endpoint.routes if "{" not in route.path)
        response = module.handler(_event_for(route, secret), LAMBDA_CONTEXT)
        assert response["statusCode"] == 403, response
        # what the request left to run beside it runs on in the environment's loop (the next invocation)
        asyncio.get_event_loop().run_until_complete(asyncio.sleep(1.0))
    finally:
        module.app.state._state.pop("gateway", None)
    grants = {(action, json.dumps(resource)) for action in set(CALL_ACTIONS.values()) | set(ITEM_ACTIONS.values())
              for resource in granted(deployed(MODES[0]), f"{endpoint.resource[:-len('Function')]}Role", action)}
    assert needed(stack.settings, recorded.calls) - grants == set()
    reclaimed = [event.status for event in stack.events(org_id)] == ["abandoned"]
    assert reclaimed == (endpoint.api is not None)  # by the functions that admit, whose roles write the org
