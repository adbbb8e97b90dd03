"""Template plugin for petals-core: the smallest complete family plugin (transformers' Mistral)."""
