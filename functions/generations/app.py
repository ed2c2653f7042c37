"""GET /v1/generations/{gen_id}, and an org's self-service: /v1/credits, /v1/key, /v1/usage, /v1/keys."""

from kiln.endpoints import GENERATIONS
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(GENERATIONS)
app = create_app(routes)
handler = lambda_handler(app)
