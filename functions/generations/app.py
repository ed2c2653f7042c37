"""GET /v1/generations/{gen_id}."""

from kiln.endpoints import GENERATIONS
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(GENERATIONS)
app = create_app(routes)
handler = lambda_handler(app)
