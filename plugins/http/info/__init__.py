"""What the server says about itself: /v1/models, /health, /slots, the Prometheus metrics and
the OpenAPI document."""
