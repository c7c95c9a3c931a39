"""Tool calls: OpenAI function tools rendered into the prompt, constrained and parsed."""
