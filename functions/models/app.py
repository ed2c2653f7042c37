"""GET /v1/models and GET /v1/models/{model_id}."""

from kiln.web import create_app, lambda_handler, model_routes

routes = model_routes()
app = create_app(routes)
handler = lambda_handler(app)
