"""The fault scenarios, one module each; chaos.suite runs them."""
