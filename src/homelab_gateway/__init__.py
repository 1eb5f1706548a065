"""homelab-gateway: an Anthropic Messages front door for self-hosted OpenAI-compatible LLMs."""
