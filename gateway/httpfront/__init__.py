"""The HTTP front end: the OpenAI-compatible API and the admin API on Starlette, and its wire rules."""
