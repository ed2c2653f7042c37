"""POST /v1/chat/completions."""

from kiln.endpoints import CHAT
from kiln.web import create_app, lambda_handler, routes_of

routes = routes_of(CHAT)
app = create_app(routes)
handler = lambda_handler(app)
