"""Training methods: each is a step function plus its metrics (base.Method)."""
