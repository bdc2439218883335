"""The gateway's own tokens: prompts to ids and ids back to text."""
