"""Same-named subclasses that an offloaded model and its served blocks take in place of their class.

What the plugin changes in a module's behaviour (the model's call holding the forward lock, its
generate, a Llama 4 block's routed forward) lives in a subclass of the module's class, of the same
name, module and qualname, that the instance takes (`module.__class__ = ...`); the class itself is
untouched, and `isinstance` holds. Methods of a class rather than methods bound to the instance: a
bound method stored on the instance is a reference cycle that kept the pools (GiBs of pinned host
memory, the slot pool on the GPU) alive after `del model` until the cyclic garbage collector ran.

Such a class cannot be pickled by reference (its name finds the original class), so:
- an instance that is offloaded refuses pickling with PICKLE_REFUSED;
- any other instance (one built through the subclass, `type(model)(config)` or
  `model.from_pretrained(path)`) pickles as an instance of the original class;
- copies (copy.copy, copy.deepcopy) keep the subclass.
"""
import copy
import copyreg
from typing import Callable, Dict, Tuple

PICKLE_REFUSED = ("an offloaded model cannot be pickled (its experts live in freetoken's host pool, its kernels' "
                  "state in the runtime): save it with model.save_pretrained(path) and load that with "
                  "freetoken_plugin.load_model(path), or with transformers' from_pretrained and then "
                  "freetoken_plugin.offload_experts (for the families whose weights transformers converts as it "
                  "loads, which load_model refuses)")

_CLASSES: Dict[Tuple[type, str], type] = {}


def _new_instance(cls: type):
    """An empty instance of `cls`, which unpickling then gives its state (copyreg.__newobj__ would
    insist on the class the instance was pickled as)."""
    return cls.__new__(cls)


def served_subclass(cls: type, role: str, methods_of: Callable[[type], Dict[str, Callable]],
                    offloaded: Callable[[object], bool]) -> type:
    """The subclass of `cls` for `role` (one per class and role, made once) with the methods
    `methods_of(cls)` returns and the pickling and copying rules above; `offloaded(instance)` tells
    whether pickling is refused. A class that already is such a subclass (a module built through
    one) counts as its base."""
    base = getattr(cls, "_freetoken_base", cls)
    served = _CLASSES.get((base, role))
    if served is None:
        def __reduce_ex__(self, protocol):
            if offloaded(self):
                raise TypeError(PICKLE_REFUSED)
            reduced = object.__reduce_ex__(self, protocol)
            if reduced[0] is copyreg.__newobj__ and reduced[1] == (served,):
                reduced = (_new_instance, (base,), *reduced[2:])
            return reduced

        # What copy does for any object (object.__reduce_ex__), which __reduce_ex__ above changes.
        def __copy__(self):
            return copy._reconstruct(self, None, *object.__reduce_ex__(self, 4))

        def __deepcopy__(self, memo):
            return copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))

        served = type(base.__name__, (base,), {
            **methods_of(base), "__reduce_ex__": __reduce_ex__, "__copy__": __copy__, "__deepcopy__": __deepcopy__,
            "_freetoken_base": base, "__module__": base.__module__, "__qualname__": base.__qualname__})
        _CLASSES[(base, role)] = served
    return served
