"""A study's setup: its config, the typed run config, models, vocabulary, warm start, the cluster."""
