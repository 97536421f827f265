// The real device layer of the CUDA IPC engine: DeviceApi over the CUDA
// runtime. Only device work lives here (copies, events, streams, IPC handles);
// the engine's host logic is in ipc_engine.cpp / ipc_worker.cpp.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
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
};

}  // namespace

std::shared_ptr<DeviceApi> cuda_runtime_api() { return std::make_shared<CudaRuntime>(); }

}  // namespace dualpipe::cuda
