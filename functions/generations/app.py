"""GET /v1/generations/{gen_id}."""

from kiln.web import create_app, generation_routes, lambda_handler

routes = generation_routes()
app = create_app(routes)
handler = lambda_handler(app)
