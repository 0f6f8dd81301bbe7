// The CPython entry point of bandpo_lut._C, and nothing else.
//
// Importing bandpo_lut._C loads this shared library, which runs the static initialisers of
// TORCH_LIBRARY / TORCH_LIBRARY_IMPL in the other translation units (csrc/ops.cpp and the
// backends): that is how the ops reach torch.ops.bandpo_lut. The module itself is empty, but for
// one string, `build_info_json` (csrc/build_info.h), so that Python can ask the library itself what
// it was built with; `divergences` ({name: id} of csrc/divergence.h) and `closed_form_divergences`, so that
// Python's registry is held to the compiled list and the loader knows which tables the kernels read; and
// `grid_fields` (csrc/table_grid.h), the order of the ops' grid argument. Import torch before this module:
// the library links against libtorch.
#include <Python.h>

#include "build_info.h"
#include "divergence.h"
#include "table_grid.h"

static int add_divergences(PyObject* module) {
  PyObject* ids = PyDict_New();
  if (ids == nullptr) return -1;
  for (const auto& d : bandpo::kDivergences) {
    PyObject* value = PyLong_FromLong(d.id);
    if (value == nullptr || PyDict_SetItemString(ids, d.name, value) < 0) {
      Py_XDECREF(value);
      Py_DECREF(ids);
      return -1;
    }
    Py_DECREF(value);
  }
  return PyModule_AddObject(module, "divergences", ids);  // steals the reference on success
}

// The names of the divergences the kernels evaluate in closed form (they read no table, only its δ range).
static int add_closed_forms(PyObject* module) {
  PyObject* names = PyList_New(0);
  if (names == nullptr) return -1;
  for (const auto& d : bandpo::kDivergences) {
    if (!d.closed_form) continue;
    PyObject* name = PyUnicode_FromString(d.name);
    const int failed = name == nullptr || PyList_Append(names, name) < 0;
    Py_XDECREF(name);
    if (failed) {
      Py_DECREF(names);
      return -1;
    }
  }
  PyObject* frozen = PyList_AsTuple(names);
  Py_DECREF(names);
  return frozen == nullptr ? -1 : PyModule_AddObject(module, "closed_form_divergences", frozen);
}

static int add_grid_fields(PyObject* module) {
  PyObject* names = PyTuple_New(bandpo::kGridLen);
  if (names == nullptr) return -1;
  for (int i = 0; i < bandpo::kGridLen; ++i) {
    PyObject* name = PyUnicode_FromString(bandpo::kGridFieldNames[i]);
    if (name == nullptr) {
      Py_DECREF(names);
      return -1;
    }
    PyTuple_SET_ITEM(names, i, name);  // steals
  }
  return PyModule_AddObject(module, "grid_fields", names);
}

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
  if (PyModule_AddStringConstant(module, "build_info_json", bandpo_build_info_json()) < 0 ||
      add_divergences(module) < 0 || add_closed_forms(module) < 0 || add_grid_fields(module) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
