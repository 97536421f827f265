// The real device layer of the CUDA IPC engine: DeviceApi over the CUDA
// runtime. Only device work lives here (copies, events, streams, IPC handles);
// the engine's host logic is in ipc_engine.cpp / ipc_worker.cpp.
#include <cuda.h>  // driver types only: the entry points are looked up at run time, libcuda is not linked
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "cuda/device_api.h"

namespace dualpipe::cuda {
namespace {

static_assert(sizeof(IpcMemHandle) == sizeof(cudaIpcMemHandle_t), "IpcMemHandle must match cudaIpcMemHandle_t");
static_assert(sizeof(IpcEventHandle) == sizeof(cudaIpcEventHandle_t), "IpcEventHandle must match cudaIpcEventHandle_t");
static_assert(kNotReady == static_cast<int>(cudaErrorNotReady), "kNotReady must be cudaErrorNotReady");

Status st(cudaError_t e) { return static_cast<Status>(e); }
cudaStream_t S(Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t E(Event e) { return static_cast<cudaEvent_t>(e); }

cudaMemcpyKind kind_of(CopyKind k) {
  switch (k) {
    case CopyKind::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::kHostToDevice: return cudaMemcpyHostToDevice;
    default: return cudaMemcpyDeviceToDevice;
  }
}

// Fallback signals where the device has no 64-bit stream memory operations:
// one thread stores (after a system-wide fence) or spins on the value.  (Kernels and their launches only
// where nvcc compiles this file; a plain C++ compiler reads the host code alone: the C++17 syntax check.)
#if defined(__CUDACC__)
__global__ void signal_write_kernel(volatile unsigned long long* addr, unsigned long long value) {
  __threadfence_system();
  *addr = value;
  __threadfence_system();
}

__global__ void signal_wait_kernel(volatile unsigned long long* addr, unsigned long long value) {
  while (static_cast<long long>(*addr - value) < 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(200);
#endif
  }
  __threadfence_system();
}
#endif  // __CUDACC__

using WriteValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WaitValue64Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using DeviceGetAttributeFn = CUresult (*)(int*, CUdevice_attribute, CUdevice);

void* driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess) fn = nullptr;
#else
  if (cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q) != cudaSuccess) fn = nullptr;
#endif
  (void)cudaGetLastError();
  return q == cudaDriverEntryPointSuccess ? fn : nullptr;
}

class CudaRuntime final : public DeviceApi {
 public:
  std::string error_text(Status s) override {
    (void)cudaGetLastError();  // clear a non-sticky error so later unrelated calls do not report it
    const auto e = static_cast<cudaError_t>(s);
    return std::string(cudaGetErrorName(e)) + " (" + cudaGetErrorString(e) + ")";
  }
  Status device_count(int* n) override { return st(cudaGetDeviceCount(n)); }
  Status get_device(int* d) override { return st(cudaGetDevice(d)); }
  Status set_device(int d) override { return st(cudaSetDevice(d)); }
  Status stream_create(Stream* s) override {
    int least = 0, greatest = 0;
    if (cudaError_t r = cudaDeviceGetStreamPriorityRange(&least, &greatest); r != cudaSuccess) return st(r);
    cudaStream_t out = nullptr;
    const cudaError_t r = cudaStreamCreateWithPriority(&out, cudaStreamNonBlocking, greatest);
    *s = out;
    return st(r);
  }
  Status stream_destroy(Stream s) override { return st(cudaStreamDestroy(S(s))); }
  Status stream_query(Stream s) override { return st(cudaStreamQuery(S(s))); }
  Status stream_wait_event(Stream s, Event e) override { return st(cudaStreamWaitEvent(S(s), E(e), 0)); }
  Status event_create(Event* e, bool interprocess) override {
    cudaEvent_t out = nullptr;
    const unsigned flags = interprocess ? (cudaEventDisableTiming | cudaEventInterprocess) : cudaEventDisableTiming;
    const cudaError_t r = cudaEventCreateWithFlags(&out, flags);
    *e = out;
    return st(r);
  }
  Status event_destroy(Event e) override { return st(cudaEventDestroy(E(e))); }
  Status event_record(Event e, Stream s) override { return st(cudaEventRecord(E(e), S(s))); }
  Status event_query(Event e) override { return st(cudaEventQuery(E(e))); }
  Status ipc_get_event_handle(IpcEventHandle* h, Event e) override {
    cudaIpcEventHandle_t raw{};
    const cudaError_t r = cudaIpcGetEventHandle(&raw, E(e));
    std::memcpy(h->bytes, &raw, sizeof raw);
    return st(r);
  }
  Status ipc_open_event_handle(Event* e, const IpcEventHandle& h) override {
    cudaIpcEventHandle_t raw{};
    std::memcpy(&raw, h.bytes, sizeof raw);
    cudaEvent_t out = nullptr;
    const cudaError_t r = cudaIpcOpenEventHandle(&out, raw);
    *e = out;
    return st(r);
  }
  Status malloc(void** p, std::size_t bytes) override { return st(cudaMalloc(p, bytes)); }
  Status free(void* p) override { return st(cudaFree(p)); }
  Status ipc_get_mem_handle(IpcMemHandle* h, void* p) override {
    cudaIpcMemHandle_t raw{};
    const cudaError_t r = cudaIpcGetMemHandle(&raw, p);
    std::memcpy(h->bytes, &raw, sizeof raw);
    return st(r);
  }
  Status ipc_open_mem_handle(void** p, const IpcMemHandle& h) override {
    cudaIpcMemHandle_t raw{};
    std::memcpy(&raw, h.bytes, sizeof raw);
    return st(cudaIpcOpenMemHandle(p, raw, cudaIpcMemLazyEnablePeerAccess));
  }
  Status ipc_close_mem_handle(void* p) override { return st(cudaIpcCloseMemHandle(p)); }
  Status host_register(void* p, std::size_t bytes) override {
    return st(cudaHostRegister(p, bytes, cudaHostRegisterPortable));
  }
  Status host_unregister(void* p) override { return st(cudaHostUnregister(p)); }
  Status memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream s) override {
    return st(cudaMemcpyAsync(dst, src, bytes, kind_of(kind), S(s)));
  }

  Status stream_write_value(Stream s, void* addr, std::uint64_t value) override {
    resolve();
    if (write_ != nullptr) {
      const CUresult r = write_(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), value, 0);
      return r == CUDA_SUCCESS ? kOk : driver_error(r);
    }
#if defined(__CUDACC__)
    signal_write_kernel<<<1, 1, 0, S(s)>>>(static_cast<unsigned long long*>(addr), value);
    return st(cudaGetLastError());
#else
    return st(cudaErrorNotSupported);
#endif
  }
  Status stream_wait_value(Stream s, void* addr, std::uint64_t value) override {
    resolve();
    if (wait_ != nullptr) {
      const CUresult r = wait_(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(addr), value,
                               CU_STREAM_WAIT_VALUE_GEQ);
      return r == CUDA_SUCCESS ? kOk : driver_error(r);
    }
#if defined(__CUDACC__)
    signal_wait_kernel<<<1, 1, 0, S(s)>>>(static_cast<unsigned long long*>(addr), value);
    return st(cudaGetLastError());
#else
    return st(cudaErrorNotSupported);
#endif
  }
  Status set_value(void* addr, std::uint64_t value) override {
    return st(cudaMemcpy(addr, &value, sizeof value, cudaMemcpyHostToDevice));
  }
  std::string signal_mechanism() override {
    resolve();
    return write_ != nullptr ? "stream memory ops" : "spin kernels";
  }

 private:
  // The driver's 64-bit stream memory operations, when this device has them
  // (DPK_IPC_SIGNALS=kernel forces the spin-kernel fallback).
  void resolve() {
    std::call_once(resolved_, [this] {
      const char* force = std::getenv("DPK_IPC_SIGNALS");
      if (force != nullptr && std::strcmp(force, "kernel") == 0) return;
      auto attr = reinterpret_cast<DeviceGetAttributeFn>(driver_entry_point("cuDeviceGetAttribute"));
      int device = 0, ok = 0;
      if (attr == nullptr || cudaGetDevice(&device) != cudaSuccess ||
          attr(&ok, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS || ok == 0) {
        (void)cudaGetLastError();
        return;
      }
      auto w = reinterpret_cast<WriteValue64Fn>(driver_entry_point("cuStreamWriteValue64"));
      auto v = reinterpret_cast<WaitValue64Fn>(driver_entry_point("cuStreamWaitValue64"));
      if (w != nullptr && v != nullptr) write_ = w, wait_ = v;
    });
  }
  // CUresult and cudaError_t share their numbering for the errors these calls
  // return (invalid value, not supported, launch failures), so error_text names them.
  static Status driver_error(CUresult r) { return static_cast<Status>(r); }

  std::once_flag resolved_;
  WriteValue64Fn write_ = nullptr;
  WaitValue64Fn wait_ = nullptr;
};

}  // namespace

std::shared_ptr<DeviceApi> cuda_runtime_api() { return std::make_shared<CudaRuntime>(); }

}  // namespace dualpipe::cuda
