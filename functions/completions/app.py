"""POST /v1/completions."""

from kiln.endpoints import COMPLETIONS
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(COMPLETIONS)
app = create_app(routes)
handler = lambda_handler(app)
