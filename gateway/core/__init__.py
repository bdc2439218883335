"""The request path every front end shares: prepare, admit, plan, execute, account."""
