// The CUDA runtime calls of the IPC engine, behind an interface a test can fake.
//
// No CUDA header here: streams and events are opaque pointers and IPC handles
// are their 64 bytes, so the engine's host logic (ipc_engine.cpp,
// ipc_worker.cpp) builds and runs under CMake, ThreadSanitizer and
// AddressSanitizer without a GPU (csrc/tests/fake_device.h). The real
// implementation is csrc/cuda/cuda_runtime.cu, the only file that includes
// cuda_runtime.h besides the bindings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace dualpipe::cuda {

using Stream = void*;  //!< cudaStream_t
using Event = void*;   //!< cudaEvent_t

inline constexpr std::size_t kIpcHandleBytes = 64;  //!< CUDA_IPC_HANDLE_SIZE
struct IpcMemHandle {
  char bytes[kIpcHandleBytes];
};
struct IpcEventHandle {
  char bytes[kIpcHandleBytes];
};

enum class CopyKind { kDeviceToDevice, kDeviceToHost, kHostToDevice };

//! Outcome of a call: kOk, kNotReady (a query whose work is still running) or
//! an error code (the CUDA error number in the real implementation).
using Status = int;
inline constexpr Status kOk = 0;
inline constexpr Status kNotReady = 600;  //!< cudaErrorNotReady

class DeviceApi {
 public:
  virtual ~DeviceApi() = default;
  //! "cudaErrorX (description)"; clears a non-sticky error so later calls do not report it.
  virtual std::string error_text(Status s) = 0;
  virtual Status device_count(int* n) = 0;
  virtual Status get_device(int* device) = 0;
  virtual Status set_device(int device) = 0;
  //! A non-blocking stream of the highest priority.
  virtual Status stream_create(Stream* s) = 0;
  virtual Status stream_destroy(Stream s) = 0;
  virtual Status stream_query(Stream s) = 0;
  virtual Status stream_wait_event(Stream s, Event e) = 0;
  //! Timing disabled; `interprocess` events can be exported.
  virtual Status event_create(Event* e, bool interprocess) = 0;
  virtual Status event_destroy(Event e) = 0;
  virtual Status event_record(Event e, Stream s) = 0;
  virtual Status event_query(Event e) = 0;
  virtual Status ipc_get_event_handle(IpcEventHandle* h, Event e) = 0;
  virtual Status ipc_open_event_handle(Event* e, const IpcEventHandle& h) = 0;
  virtual Status malloc(void** p, std::size_t bytes) = 0;
  virtual Status free(void* p) = 0;
  virtual Status ipc_get_mem_handle(IpcMemHandle* h, void* p) = 0;
  //! Opening a handle this process already opened returns the same pointer
  //! (the driver counts references; each open needs its close).
  virtual Status ipc_open_mem_handle(void** p, const IpcMemHandle& h) = 0;
  virtual Status ipc_close_mem_handle(void* p) = 0;
  virtual Status host_register(void* p, std::size_t bytes) = 0;
  virtual Status host_unregister(void* p) = 0;
  virtual Status memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream s) = 0;

  // 64-bit signals in device memory (own or IPC-mapped), written and awaited
  // by the streams themselves: no event, no host thread in the loop. The real
  // layer uses the driver's stream memory operations (cuStreamWriteValue64 /
  // cuStreamWaitValue64, looked up at run time) or, where the device lacks
  // them, one-thread kernels that store / spin.
  //! After the work queued on `s` so far, stores `value` at `addr` (with a memory barrier).
  virtual Status stream_write_value(Stream s, void* addr, std::uint64_t value) = 0;
  //! Work queued on `s` after this waits until (int64_t)(*addr - value) >= 0 (wrap-around safe).
  virtual Status stream_wait_value(Stream s, void* addr, std::uint64_t value) = 0;
  //! Stores `value` at `addr` from the host, synchronously (initial values; releasing
  //! streams that wait for a peer that died).
  virtual Status set_value(void* addr, std::uint64_t value) = 0;
  //! How stream signals are made here, for reports ("stream memory ops", "spin kernels", "fake").
  virtual std::string signal_mechanism() = 0;
};

//! Wrap-around-safe "a has reached b" for monotonic 64-bit counters (the comparison the streams make).
inline bool reached(std::uint64_t a, std::uint64_t b) { return static_cast<std::int64_t>(a - b) >= 0; }

//! The CUDA runtime (cuda_runtime.cu; CUDA builds only).
std::shared_ptr<DeviceApi> cuda_runtime_api();

//! Throws std::runtime_error "<call> failed: <error text>" unless `s` is kOk.
void check(DeviceApi& api, Status s, const char* call);

//! Non-blocking query of an event or stream: true when done, false while
//! running, throws on an error.
bool finished(DeviceApi& api, Status s, const char* call);

//! Makes `device` current for the calling thread; restores the previous one on scope exit.
class DeviceGuard {
 public:
  DeviceGuard(DeviceApi& api, int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  DeviceApi& api_;
  int previous_ = 0;
};

}  // namespace dualpipe::cuda
