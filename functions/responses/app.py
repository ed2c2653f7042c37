"""POST /v1/responses (the Responses API)."""

from kiln.endpoints import RESPONSES
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(RESPONSES)
app = create_app(routes)
handler = lambda_handler(app)
