"""What clients speak to the gateway: the Anthropic Messages API and plain proxy routes."""
