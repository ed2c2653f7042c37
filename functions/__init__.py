"""One small app per Lambda function; the logic lives in the shared layer (`kiln`)."""
