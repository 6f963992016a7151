"""Warnings attributed to the user's own code: the line that called into ft_ops or the plugin, not
a line inside them (the depth of that call varies with the entry point: offload_experts, load_model,
the CLI)."""
import os
import sys
import warnings

_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


def _library_dirs():
    plugin = sys.modules.get("freetoken_plugin")
    plugin_dir = (os.path.dirname(os.path.abspath(plugin.__file__)) + os.sep
                  if plugin is not None and getattr(plugin, "__file__", None) else None)
    return _LIBRARY_DIRS + ((plugin_dir,) if plugin_dir else ())


def warn(message: str, category=UserWarning) -> None:
    """warnings.warn(message) at the first frame outside ft_ops and freetoken_plugin."""
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and (os.path.abspath(frame.f_code.co_filename) + os.sep).startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
