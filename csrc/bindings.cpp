// dualpipe_kernels._C: one register_apis(m) per subsystem, plus build facts.
#include <pybind11/pybind11.h>

#include "common/native_traceback.h"
#include "shm_bindings.h"
#ifdef DUALPIPE_KERNELS_WITH_CUDA
#include "cuda/api.h"
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

// Build facts arrive as -D macros from setup.py / CMake (unquoted tokens, so
// they survive the shell); the variadic stringifier keeps commas intact.
#define DPK_STR_(...) #__VA_ARGS__
#define DPK_STR(...) DPK_STR_(__VA_ARGS__)
#ifndef DUALPIPE_KERNELS_VERSION
#define DUALPIPE_KERNELS_VERSION unknown
#endif
#ifndef DUALPIPE_KERNELS_ARCH_LIST
#define DUALPIPE_KERNELS_ARCH_LIST none
#endif
#ifndef DUALPIPE_KERNELS_TORCH_VERSION
#define DUALPIPE_KERNELS_TORCH_VERSION unknown
#endif
#ifndef DUALPIPE_KERNELS_CUDA_VERSION
#define DUALPIPE_KERNELS_CUDA_VERSION none
#endif

namespace py = pybind11;

namespace {

py::dict build_info() {
  py::dict d;
  d["version"] = DPK_STR(DUALPIPE_KERNELS_VERSION);
  d["with_cuda"] = kWithCuda;
  d["cuda_version"] = kWithCuda ? py::str(DPK_STR(DUALPIPE_KERNELS_CUDA_VERSION)) : py::str("");
  d["cuda_arch_list"] = kWithCuda ? py::str(DPK_STR(DUALPIPE_KERNELS_ARCH_LIST)) : py::str("");
  d["torch_version"] = DPK_STR(DUALPIPE_KERNELS_TORCH_VERSION);
  d["compiler"] = __VERSION__;
  d["cplusplus"] = static_cast<long>(__cplusplus);
  d["subsystems"] = kWithCuda ? py::list(py::make_tuple("shm", "cuda")) : py::list(py::make_tuple("shm"));
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dualpipe-kernels native comm engine (shared-memory channels; CUDA IPC in CUDA builds)";
  m.def("has_cuda", [] { return kWithCuda; }, "True if this build compiled the CUDA sources.");
  m.def("build_info", &build_info, "Facts about this build: version, CUDA, architectures, compiler.");
  m.def("install_native_traceback", &dualpipe::install_native_traceback,
        "Native stacks on fatal signals and on SIGUSR2 (see common/native_traceback.h).");
  dualpipe::shm::register_apis(m);
#ifdef DUALPIPE_KERNELS_WITH_CUDA
  dualpipe::cuda::register_apis(m);
#endif
}
