// Python registration of the CUDA path of the native comm engine.
//
// Compiled only in a CUDA build (setup.py defines DUALPIPE_KERNELS_WITH_CUDA);
// csrc/bindings.cpp calls register_apis(m) on the module dualpipe_kernels._C,
// which adds the submodule dualpipe_kernels._C.cuda (IpcEngine, IpcOp, ...).
#pragma once

#include <pybind11/pybind11.h>

namespace dualpipe::cuda {

void register_apis(pybind11::module_& m);

}  // namespace dualpipe::cuda
