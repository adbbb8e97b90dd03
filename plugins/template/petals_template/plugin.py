"""The module the entry point names. Implement only the hooks where your family differs from
core's defaults (see plugins/README.md); registering the config is the one hook every plugin has."""

from petals import hookimpl
from petals_template.config import DistributedTemplateConfig


@hookimpl
def register_model_families(register) -> None:
    register(DistributedTemplateConfig)
