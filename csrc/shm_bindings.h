// Python registration of the CPU shared-memory engine (dualpipe_kernels._C.shm).
#pragma once

#include <pybind11/pybind11.h>

namespace dualpipe::shm {

void register_apis(pybind11::module_& m);

}  // namespace dualpipe::shm
