"""The plugin manager: loads the ``petals`` entry-point group and answers "which family serves this?".

Plugins are loaded on first use, not when ``petals`` is imported. Two environment variables
choose which installed plugins load (by entry-point name):

* ``PETALS_PLUGINS=name1,name2`` loads only those (set but empty: load none);
* ``PETALS_DISABLE_PLUGINS=name3`` loads all but those.

A plugin that fails to import is reported with its name and error and does not stop the others.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pluggy

from petals import default_hooks, hookspecs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "petals"
ALLOW_ENV = "PETALS_PLUGINS"
BLOCK_ENV = "PETALS_DISABLE_PLUGINS"
DEFAULT_HOOKS_NAME = "petals.default_hooks"


class PluginError(Exception):
    """A problem with the installed model-family plugins."""


class UnknownModelTypeError(PluginError, ValueError):
    """No installed plugin serves a model type."""


class DuplicateModelTypeError(PluginError):
    """Two plugins claim the same model type."""


@dataclass(frozen=True)
class PluginFailure:
    name: str
    error: str


@dataclass(frozen=True)
class PluginDistribution:
    name: str
    version: str


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    config_class: type
    plugin: str


class PluginManager(pluggy.PluginManager):
    """pluggy's manager plus what ``petals plugins`` reports: distributions and load failures."""

    def __init__(self) -> None:
        super().__init__(ENTRY_POINT_GROUP)
        self.add_hookspecs(hookspecs)
        self.register(default_hooks, name=DEFAULT_HOOKS_NAME)
        self.distributions: dict[str, PluginDistribution] = {}
        self.failures: list[PluginFailure] = []
        self.skipped: dict[str, str] = {}  # installed plugins not loaded -> the variable that left them out

    def load_entry_points(self, allow: set[str] | None = None, block: set[str] = frozenset()) -> None:
        for entry_point in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=_ep_name):
            if entry_point.name in block:
                self.skipped[entry_point.name] = f"{BLOCK_ENV} names it"
                continue
            if allow is not None and entry_point.name not in allow:
                self.skipped[entry_point.name] = f"{ALLOW_ENV} does not name it"
                continue
            if self.get_plugin(entry_point.name) is not None:
                continue
            try:
                plugin = entry_point.load()
            except Exception as error:  # any import error of a third-party plugin must not break the others
                failure = PluginFailure(entry_point.name, f"{type(error).__name__}: {error}")
                self.failures.append(failure)
                logger.warning("Plugin %r failed to load and is skipped: %s", failure.name, failure.error)
                continue
            self.register(plugin, name=entry_point.name)
            if entry_point.dist is not None:
                self.distributions[entry_point.name] = PluginDistribution(
                    entry_point.dist.name, entry_point.dist.version
                )

    def model_families(self) -> dict[str, ModelFamily]:
        """Every registered model type, each with the one plugin that serves it."""
        families: dict[str, ModelFamily] = {}
        plugins = self.list_name_plugin()  # in registration order
        for name, plugin in plugins:  # one call per plugin, so that each registration is known by its plugin
            others = [other for _, other in plugins if other is not plugin]
            register = functools.partial(_register_family, families, name)
            self.subset_hook_caller("register_model_families", remove_plugins=others)(register=register)
        return families

    def family(self, model_type: str) -> ModelFamily:
        """The family serving ``model_type``, or a clear error naming what is installed."""
        families = self.model_families()
        if model_type in families:
            return families[model_type]
        installed = ", ".join(sorted(families)) or "none"
        failed = "".join(f"; plugin {f.name!r} failed to load ({f.error})" for f in self.failures)
        if self.skipped:
            skipped = ", ".join(f"{name!r} ({why})" for name, why in sorted(self.skipped.items()))
            raise UnknownModelTypeError(
                f"model type {model_type!r} has no loaded plugin; loaded: {installed}{failed}; installed but "
                f"not loaded: {skipped}. If one of those serves {model_type!r}, change {BLOCK_ENV} / {ALLOW_ENV}"
            )
        raise UnknownModelTypeError(
            f"model type {model_type!r} has no installed plugin; installed: {installed}{failed}. "
            f"Install a plugin that registers {model_type!r} (a distribution with an entry point in group "
            f"'petals'; `petals plugins` lists what is installed) or write one (see plugins/README.md)."
        )

    def family_hooks(self, config: PretrainedConfig | None) -> FamilyHooks:
        """The hooks of the plugin that registered ``config.model_type``, plus core's defaults.

        Core calls every per-family hook through this, so a plugin answers only for the model types
        it registered and never for another family. ``None`` (no config) leaves core's defaults alone.
        """
        serving = {DEFAULT_HOOKS_NAME}
        if config is not None:
            serving.add(self.family(config.model_type).plugin)
        return FamilyHooks(self, [plugin for name, plugin in self.list_name_plugin() if name not in serving])

    def plugin_names(self) -> list[str]:
        return sorted(name for name, _ in self.list_name_plugin() if name != DEFAULT_HOOKS_NAME)

    def hooks_of(self, name: str) -> list[str]:
        plugin = self.get_plugin(name)
        return sorted(caller.name for caller in self.get_hookcallers(plugin) or ())


class FamilyHooks:
    """``hooks.<name>(...)`` calls hook ``name`` on one family's plugin and core's defaults only."""

    def __init__(self, manager: PluginManager, other_plugins: list[object]) -> None:
        self._manager = manager
        self._other_plugins = other_plugins

    def __getattr__(self, name: str) -> pluggy.HookCaller:
        return self._manager.subset_hook_caller(name, remove_plugins=self._other_plugins)


def _register_family(families: dict[str, ModelFamily], plugin: str, config_class: type) -> None:
    model_type = getattr(config_class, "model_type", "")
    if not model_type:
        raise PluginError(f"plugin {plugin!r} registered {config_class!r} without a model_type")
    if model_type in families and families[model_type].plugin != plugin:
        raise DuplicateModelTypeError(
            f"model type {model_type!r} is claimed by two plugins: "
            f"{families[model_type].plugin!r} and {plugin!r}; uninstall one of them "
            f"or disable one with {BLOCK_ENV}={plugin}"
        )
    families[model_type] = ModelFamily(model_type, config_class, plugin)


def _ep_name(entry_point: importlib.metadata.EntryPoint) -> str:
    return entry_point.name


def _names_from_env(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


_lock = threading.Lock()
_manager: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, loading installed plugins on first use."""
    global _manager
    with _lock:
        if _manager is None:
            manager = PluginManager()
            manager.load_entry_points(
                allow=_names_from_env(ALLOW_ENV), block=_names_from_env(BLOCK_ENV) or set()
            )
            _manager = manager
        return _manager


@contextmanager
def using_plugin_manager(manager: PluginManager) -> Iterator[PluginManager]:
    """Temporarily replace the process-wide manager (for tests and embedding applications)."""
    global _manager
    with _lock:
        previous, _manager = _manager, manager
    try:
        yield manager
    finally:
        with _lock:
            _manager = previous
