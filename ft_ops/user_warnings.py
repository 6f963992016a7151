"""Warnings attributed to the user's own code: the line that called into ft_ops or the plugin (or
into a model that runs them), not a line inside them or inside torch and transformers (the depth of
that call varies with the entry point: offload_experts, load_model, the CLI, a model's forward)."""
import os
import sys
import warnings

_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _package_dir(name: str):
    module = sys.modules.get(name)
    return (os.path.dirname(os.path.abspath(module.__file__)) + os.sep
            if module is not None and getattr(module, "__file__", None) else None)


def _library_dirs():
    """This library's packages, and torch's and transformers' (a warning raised inside a model's
    forward names the user's call of the model, not the module machinery between)."""
    return _LIBRARY_DIRS + tuple(d for d in map(_package_dir, ("freetoken_plugin", "torch", "transformers")) if d)


def warn(message: str, category=UserWarning) -> None:
    """warnings.warn(message) at the first frame outside ft_ops, freetoken_plugin, torch and
    transformers."""
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) + os.sep).startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
