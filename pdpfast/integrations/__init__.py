"""Integrations with other libraries (imported on demand: ``pdpfast.integrations.transformers``)."""
