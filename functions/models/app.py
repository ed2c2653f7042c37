"""GET /v1/models and GET /v1/models/{model_id+}."""

from kiln.endpoints import MODELS
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(MODELS)
app = create_app(routes)
handler = lambda_handler(app)
