"""The prefixgate gateway: OpenAI-compatible front end, normalization, routing, pipeline."""
