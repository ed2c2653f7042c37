"""What `sam local start-api --parameter-overrides InvokeMode=buffered` would serve, read with
SAM CLI's own providers and no AWS credentials: every route reaches its function, every
function is a Mangum handler, and no layer has to be downloaded. And what `sam deploy
--guided` would ask: nothing about routes without authorization (its default answer to
that question aborts the deploy).

This is SAM CLI's local view, which merges API events into the OpenAPI body; what a deploy
creates is checked on the translated template (tests/ops/test_ops_sam_template.py).

Run with the SAM CLI tool environment's Python (`make validate` does), on a built template:
    .tools/sam/bin/python infra/sam_local_check.py .aws-sam/build/template.yaml
"""

from __future__ import annotations

import sys

from samcli.commands.deploy.auth_utils import auth_per_resource
from samcli.lib.providers.api_provider import ApiProvider
from samcli.lib.providers.sam_function_provider import SamFunctionProvider
from samcli.lib.providers.sam_stack_provider import SamLocalStackProvider

# kiln.endpoints' routes (SAM CLI's environment cannot import the layer; a test compares them)
EXPECTED_ROUTES = {
    ("POST", "/v1/chat/completions"): "ChatCompletionsFunction",
    ("POST", "/v1/completions"): "CompletionsFunction",
    ("POST", "/v1/responses"): "ResponsesFunction",
    ("GET", "/v1/models"): "ModelsFunction",
    ("GET", "/v1/models/{model_id+}"): "ModelsFunction",
    ("GET", "/v1/generations/{gen_id}"): "GenerationsFunction",
    ("GET", "/v1/credits"): "GenerationsFunction",
    ("GET", "/v1/key"): "GenerationsFunction",
    ("GET", "/v1/usage"): "GenerationsFunction",
    ("POST", "/v1/keys"): "GenerationsFunction",
    ("GET", "/v1/keys"): "GenerationsFunction",
    ("GET", "/v1/keys/{key_id}"): "GenerationsFunction",
    ("PATCH", "/v1/keys/{key_id}"): "GenerationsFunction",
    ("DELETE", "/v1/keys/{key_id}"): "GenerationsFunction",
}


def main(template: str) -> int:
    stacks, _ = SamLocalStackProvider.get_stacks(template, parameter_overrides={"InvokeMode": "buffered"})
    routes = {
        (method, route.path): route.function_name for route in ApiProvider(stacks).api.routes for method in route.methods
    }
    problems = [
        f"route {method} {path} -> {routes.get((method, path))}, expected {function}"
        for (method, path), function in EXPECTED_ROUTES.items()
        if routes.get((method, path)) != function
    ]
    for function in SamFunctionProvider(stacks).get_all():
        if function.handler != "app.handler":
            problems.append(f"{function.name}: handler {function.handler}, expected the Mangum app.handler")
        remote = [layer.arn for layer in function.layers if getattr(layer, "is_defined_within_template", True) is False]
        if remote:
            problems.append(f"{function.name}: layers to download: {remote}")
    defaults, _ = SamLocalStackProvider.get_stacks(template)  # what --guided reads, with the defaults
    for resource, authorized in auth_per_resource(defaults):
        if not authorized:
            problems.append(f"{resource}: sam deploy --guided would ask whether no authorization is OK")
    for problem in problems:
        print(f"sam-local-check: {problem}", file=sys.stderr)
    print(f"sam-local-check: buffered mode serves {len(routes)} routes locally: {'ok' if not problems else 'FAILED'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ".aws-sam/build/template.yaml"))
