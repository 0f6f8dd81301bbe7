// What this copy of the compiled library was built with: the BANDPO_BUILD_* macros.
//
// setup.py generates `bandpo_build_config.h` into its build folder (never into csrc/) and puts
// that folder on the include path; it defines:
//   BANDPO_BUILD_CONFIG_GENERATED     1 (absent when compiled outside setup.py)
//   BANDPO_BUILD_PACKAGE_VERSION      "0.1.0"
//   BANDPO_BUILD_WITH_CUDA            1 or 0 (agrees with -DBANDPO_WITH_CUDA=1, checked below)
//   BANDPO_BUILD_CUDA_VERSION         nvcc's release, "13.0"; "" in a CPU-only build
//   BANDPO_BUILD_TORCH_VERSION        torch.__version__ at build time, "2.14.1+cu130"
//   BANDPO_BUILD_TORCH_CUDA_VERSION   torch.version.cuda at build time, "13.0"; "" for CPU torch
//   BANDPO_BUILD_CUDA_ARCH_LIST       TORCH_CUDA_ARCH_LIST used, "9.0"; "" in a CPU-only build
//   BANDPO_BUILD_CXX_COMPILER         first line of `c++ --version`
//   BANDPO_BUILD_INFO_JSON            all of the above as one JSON object (null for "none")
// Compiled without setup.py (e.g. a torch.utils.cpp_extension.load experiment), the strings are
// "unknown" and the JSON says so. Safe to include from .cpp and .cu files; macros only, no torch.
#pragma once

#if defined(__has_include)
#if __has_include("bandpo_build_config.h")
#include "bandpo_build_config.h"
#endif
#endif

#ifndef BANDPO_BUILD_CONFIG_GENERATED
#define BANDPO_BUILD_CONFIG_GENERATED 0
#define BANDPO_BUILD_PACKAGE_VERSION "unknown"
#ifdef BANDPO_WITH_CUDA
#define BANDPO_BUILD_WITH_CUDA 1
#define BANDPO_BUILD_INFO_JSON "{\"with_cuda\": true, \"generated\": false}"
#else
#define BANDPO_BUILD_WITH_CUDA 0
#define BANDPO_BUILD_INFO_JSON "{\"with_cuda\": false, \"generated\": false}"
#endif
#define BANDPO_BUILD_CUDA_VERSION "unknown"
#define BANDPO_BUILD_TORCH_VERSION "unknown"
#define BANDPO_BUILD_TORCH_CUDA_VERSION "unknown"
#define BANDPO_BUILD_CUDA_ARCH_LIST "unknown"
#define BANDPO_BUILD_CXX_COMPILER "unknown"
#endif

#if BANDPO_BUILD_CONFIG_GENERATED
#if defined(BANDPO_WITH_CUDA) != (BANDPO_BUILD_WITH_CUDA != 0)
#error \
    "BANDPO_WITH_CUDA disagrees with the generated bandpo_build_config.h: stale build folder? Remove build/ and rebuild."
#endif
#endif

// The build facts as a JSON object, e.g. for an op `bandpo_lut::build_info() -> str`.
inline const char* bandpo_build_info_json() noexcept { return BANDPO_BUILD_INFO_JSON; }
