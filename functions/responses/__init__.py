"""Lambda function package; the handler is app.handler."""
