"""The HTTP gateway: Anthropic and OpenAI wire formats over one engine client."""
