// The Python extension module ft_ops._C. It holds no Python functions: importing it loads the
// shared library, whose static initializers register the freetoken ops with the dispatcher.
#include <Python.h>

extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C",
                                      "freetoken operator kernels (use torch.ops.freetoken)", -1,
                                      nullptr};
  return PyModule_Create(&module);
}
}
