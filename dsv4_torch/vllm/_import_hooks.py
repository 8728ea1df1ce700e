"""Run a function on a module right after it is imported (or now, if it already is).

The plugin patches vLLM's DeepSeek-V4 modules only when vLLM itself imports them, so loading the
plugin costs a serving process nothing for other models and never changes vLLM's import order.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable

_lock = threading.Lock()
_hooks: dict[str, list[Callable]] = {}
_finder: _PostImportFinder | None = None


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then the hooks; everything else is forwarded to that loader."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in _pop(self._name):
            hook(module)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, resource readers...
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: asks the finders after it, and wraps the loader of a hooked name."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


def _pop(name: str) -> list[Callable]:
    with _lock:
        return _hooks.pop(name, [])


def when_imported(name: str, hook: Callable) -> None:
    """Call `hook(module)` once module `name` is imported: now if it is, else right after."""
    global _finder
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(hook)
            if _finder is None:
                _finder = _PostImportFinder()
                sys.meta_path.insert(0, _finder)
    if module is not None:
        hook(module)


def pending() -> list[str]:
    """Names of modules whose hooks have not run yet (for tests and diagnostics)."""
    with _lock:
        return sorted(_hooks)
