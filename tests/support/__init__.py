"""Test support: the skip summary plugin and the SGLang CPU shims."""
