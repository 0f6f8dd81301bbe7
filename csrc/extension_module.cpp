// The CPython entry point of bandpo_lut._C, and nothing else.
//
// Importing bandpo_lut._C loads this shared library, which runs the static initialisers of
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL in the other translation units (csrc/ops.cpp and the
// backends): that is how the ops reach torch.ops.bandpo_lut. The module itself is empty, but for
// one string, `facts_json` (csrc/facts.h): what the library was built with and every C++ fact Python
// must agree with, so that Python asks the library itself. Import torch before this module: the
// library links against libtorch.
#include <Python.h>

#include <string>

#include "facts.h"

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",                                                                     // name
      "bandpo_lut compiled ops; they are registered in torch.ops.bandpo_lut.",  // doc
      -1,                                                                       // no per-interpreter state
      nullptr,                                                                  // no methods
  };
  PyObject* module = PyModule_Create(&module_def);
  if (module == nullptr) {
    return nullptr;
  }
  const std::string facts = bandpo::facts_json();
  if (PyModule_AddStringConstant(module, "facts_json", facts.c_str()) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
