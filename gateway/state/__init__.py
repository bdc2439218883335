"""State every replica shares: documents, pins and quotas over one small store (memory or Redis)."""
