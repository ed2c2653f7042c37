"""POST /v1/completions."""

from kiln.normalize import COMPLETIONS
from kiln.web import completion_routes, create_app, lambda_handler

routes = completion_routes("/v1/completions", COMPLETIONS, "Create a text completion")
app = create_app(routes)
handler = lambda_handler(app)
