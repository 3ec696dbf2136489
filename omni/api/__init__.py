"""What every OMNI server shares: OpenAI schemas, error bodies, the streaming relay."""
