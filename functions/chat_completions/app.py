"""POST /v1/chat/completions."""

from kiln.normalize import CHAT
from kiln.web import completion_routes, create_app, lambda_handler

routes = completion_routes("/v1/chat/completions", CHAT, "Create a chat completion")
app = create_app(routes)
handler = lambda_handler(app)
