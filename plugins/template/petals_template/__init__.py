"""Template plugin for petals-core: the smallest complete family plugin, for the made-up model type
"petals_template" (transformers' Mistral under another name)."""
