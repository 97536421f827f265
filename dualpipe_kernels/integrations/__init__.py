"""Integrations with the frameworks users train with (docs/integrations.md); each module is imported on its own."""
