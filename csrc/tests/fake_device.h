// A fake CUDA device for the IPC engine's unit tests: host memory stands in
// for device memory, copies run at once (a stream is always idle unless told
// to hang, or held: then events recorded on it stay pending until released),
// and "IPC handles" carry a pointer plus the allocation's serial number, so
// two engines in one process can talk through it. Like the caching
// allocator, a freed block is handed out again for the next malloc of the
// same size (same address, new serial). It checks what CUDA leaves undefined:
// freeing memory while another side still maps it, opening a handle of freed
// or freed-and-reallocated memory, destroying an event another side has
// open, using a destroyed event, closing a mapping twice. Faults can be
// injected per call; calls that matter for cost are counted.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_api.h"

namespace dualpipe::cuda::testing {

class FakeDevice final : public DeviceApi {
 public:
  static constexpr Status kFakeError = 999;

  // Faults to inject (checked at each call).
  std::atomic<bool> fail_get_event_handle{false};
  std::atomic<bool> fail_open_mem_handle{false};
  std::atomic<bool> fail_open_event_handle{false};
  std::atomic<bool> fail_get_mem_handle{false};
  std::atomic<bool> streams_hang{false};  // stream_query reports kNotReady forever
  std::atomic<int> get_mem_handle_calls{0};

  FakeDevice() = default;
  FakeDevice(const FakeDevice&) = delete;
  FakeDevice& operator=(const FakeDevice&) = delete;
  ~FakeDevice() override {
    for (auto& [p, a] : allocs_) std::free(p);
    for (auto& [p, bytes] : cached_) std::free(p);
  }

  //! Work queued on `s` from now on does not finish (its events stay pending)
  //! until release_stream(s): a copy that is still running on the device.
  void hold_stream(Stream s) {
    std::lock_guard<std::mutex> lk(mu_);
    held_.push_back(s);
  }
  void release_stream(Stream s) {
    std::lock_guard<std::mutex> lk(mu_);
    held_.erase(std::remove(held_.begin(), held_.end(), s), held_.end());
    for (FakeEvent& e : events_) {
      if (e.on == s) e.pending = false;
    }
  }
  bool is_allocated(const void* p) const {
    std::lock_guard<std::mutex> lk(mu_);
    return allocs_.count(const_cast<void*>(p)) != 0;
  }
  //! IPC mappings open on the allocation at `p` (0 if it is not allocated).
  int mappings_of(const void* p) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.find(const_cast<void*>(p));
    return it == allocs_.end() ? 0 : it->second.opened;
  }

  //! Every violation of CUDA's rules seen so far.
  std::vector<std::string> violations() const {
    std::lock_guard<std::mutex> lk(mu_);
    return violations_;
  }
  std::vector<std::size_t> malloc_sizes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return malloc_sizes_;
  }
  int open_mappings() const {
    std::lock_guard<std::mutex> lk(mu_);
    int n = 0;
    for (const auto& [p, a] : allocs_) n += a.opened;
    return n;
  }
  std::size_t live_allocations() const {
    std::lock_guard<std::mutex> lk(mu_);
    return allocs_.size();
  }

  std::string error_text(Status s) override { return "fakeError" + std::to_string(s) + " (injected)"; }
  Status device_count(int* n) override { return *n = 1, kOk; }
  Status get_device(int* d) override { return *d = 0, kOk; }
  Status set_device(int d) override { return d == 0 ? kOk : kFakeError; }
  Status stream_create(Stream* s) override { return *s = new_event(false, false), kOk; }  // any unique token
  Status stream_destroy(Stream s) override { return destroy(s); }
  Status stream_query(Stream s) override {
    std::lock_guard<std::mutex> lk(mu_);
    return streams_hang || std::find(held_.begin(), held_.end(), s) != held_.end() ? kNotReady : kOk;
  }
  Status stream_wait_event(Stream, Event e) override { return use(e); }
  Status event_create(Event* e, bool interprocess) override { return *e = new_event(interprocess, false), kOk; }
  Status event_destroy(Event e) override { return destroy(e); }
  Status event_record(Event e, Stream s) override {
    if (Status r = use(e); r != kOk) return r;
    std::lock_guard<std::mutex> lk(mu_);
    FakeEvent& ev = events_[reinterpret_cast<std::size_t>(e) - 1];
    ev.pending = std::find(held_.begin(), held_.end(), s) != held_.end();
    ev.on = ev.pending ? s : nullptr;
    return kOk;
  }
  Status event_query(Event e) override {
    if (Status r = use(e); r != kOk) return r;
    std::lock_guard<std::mutex> lk(mu_);
    return events_[reinterpret_cast<std::size_t>(e) - 1].pending ? kNotReady : kOk;
  }
  Status ipc_get_event_handle(IpcEventHandle* h, Event e) override {
    if (fail_get_event_handle) return kFakeError;
    std::memset(h->bytes, 0, sizeof h->bytes);
    std::memcpy(h->bytes, &e, sizeof e);
    return use(e);
  }
  Status ipc_open_event_handle(Event* e, const IpcEventHandle& h) override {
    if (fail_open_event_handle) return kFakeError;
    Event target = nullptr;
    std::memcpy(&target, h.bytes, sizeof target);
    if (Status s = use(target); s != kOk) return s;
    *e = new_event(false, true);
    return kOk;
  }
  Status malloc(void** p, std::size_t bytes) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto cached = std::find_if(cached_.begin(), cached_.end(), [&](const auto& c) { return c.second == bytes; });
    if (cached != cached_.end()) {  // the same address again, as a caching allocator would
      *p = cached->first;
      cached_.erase(cached);
      std::memset(*p, 0, bytes);
    } else {
      *p = std::calloc(1, bytes);
    }
    allocs_[*p] = Alloc{bytes, 0, ++serial_};
    malloc_sizes_.push_back(bytes);
    return kOk;
  }
  Status free(void* p) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.find(p);
    if (it == allocs_.end()) return violation("cudaFree of an unknown pointer");
    if (it->second.opened > 0) return violation("cudaFree while another side still maps the allocation");
    cached_.emplace_back(p, it->second.bytes);
    allocs_.erase(it);
    return kOk;
  }
  Status ipc_get_mem_handle(IpcMemHandle* h, void* p) override {
    ++get_mem_handle_calls;
    if (fail_get_mem_handle) return kFakeError;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.find(p);
    if (it == allocs_.end()) return violation("cudaIpcGetMemHandle of a pointer that is not an allocation start");
    std::memset(h->bytes, 0, sizeof h->bytes);
    std::memcpy(h->bytes, &p, sizeof p);
    std::memcpy(h->bytes + sizeof p, &it->second.serial, sizeof it->second.serial);
    return kOk;
  }
  Status ipc_open_mem_handle(void** p, const IpcMemHandle& h) override {
    if (fail_open_mem_handle) return kFakeError;
    std::lock_guard<std::mutex> lk(mu_);
    void* target = nullptr;
    std::uint64_t serial = 0;
    std::memcpy(&target, h.bytes, sizeof target);
    std::memcpy(&serial, h.bytes + sizeof target, sizeof serial);
    auto it = allocs_.find(target);
    if (it == allocs_.end()) return violation("cudaIpcOpenMemHandle of freed memory");
    if (it->second.serial != serial) return violation("cudaIpcOpenMemHandle of a stale handle (memory freed and reallocated)");
    ++it->second.opened;
    *p = target;
    return kOk;
  }
  Status ipc_close_mem_handle(void* p) override {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = allocs_.find(p);
    if (it == allocs_.end() || it->second.opened == 0) return violation("cudaIpcCloseMemHandle without an open");
    --it->second.opened;
    return kOk;
  }
  Status host_register(void*, std::size_t) override { return kOk; }
  Status host_unregister(void*) override { return kOk; }
  Status memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind, Stream) override {
    // Serialised: the engines' counters live in a segment each maps at its own
    // address, so ThreadSanitizer cannot see that they order these copies.
    std::lock_guard<std::mutex> lk(mu_);
    std::memcpy(dst, src, bytes);
    return kOk;
  }

 private:
  struct Alloc {
    std::size_t bytes = 0;
    int opened = 0;  // IPC mappings open on it
    std::uint64_t serial = 0;  // which allocation this is, should the address come back
  };
  struct FakeEvent {
    bool alive = true;
    bool pending = false;  // recorded on a held stream, not reached yet
    Stream on = nullptr;
  };

  Event new_event(bool interprocess, bool imported) {
    std::lock_guard<std::mutex> lk(mu_);
    events_.emplace_back();
    return reinterpret_cast<Event>(events_.size());  // ids from 1; never null
  }
  Status use(Event e) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto id = reinterpret_cast<std::size_t>(e);
    if (id == 0 || id > events_.size()) return violation("use of an unknown event or stream");
    if (!events_[id - 1].alive) return violation("use of a destroyed event or stream");
    return kOk;
  }
  Status destroy(Event e) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto id = reinterpret_cast<std::size_t>(e);
    if (id == 0 || id > events_.size() || !events_[id - 1].alive) return violation("destroy of a dead event");
    events_[id - 1].alive = false;
    return kOk;
  }
  Status violation(const std::string& what) {  // mu_ held
    violations_.push_back(what);
    return kFakeError;
  }

  mutable std::mutex mu_;
  std::map<void*, Alloc> allocs_;
  std::vector<std::pair<void*, std::size_t>> cached_;  // freed blocks, handed out again by size
  std::vector<Stream> held_;
  std::uint64_t serial_ = 0;
  std::vector<FakeEvent> events_;
  std::vector<std::size_t> malloc_sizes_;
  std::vector<std::string> violations_;
};

}  // namespace dualpipe::cuda::testing
