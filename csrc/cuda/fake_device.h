// A fake CUDA device for the IPC engine's unit tests and its host-cost
// benchmark (`bench cuda_ipc --fake-device`): host memory stands in for
// device memory, and each stream is an in-order queue of its work (copies,
// event records and waits, 64-bit signal writes and waits) that runs as soon
// as it can: whenever anything is enqueued or a value is set, every stream
// runs until its head must wait (a signal below its target, an event whose
// record has not run) or the stream is held (hold_stream: work queued there
// stays queued until release_stream). "IPC handles" carry a pointer plus the
// allocation's serial number, so two engines in one process talk through it. Like the caching
// allocator, a freed block is handed out again for the next malloc of the
// same size (same address, new serial). It checks what CUDA leaves undefined:
// freeing memory while another side still maps it, opening a handle of freed
// or freed-and-reallocated memory, destroying an event another side has
// open, using a destroyed event, closing a mapping twice. Faults can be
// injected per call; calls that matter for cost are counted.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
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
  // false: copies are accounted but move no bytes (the host-cost benchmark:
  // a copy is the device's time, not the host's)
  std::atomic<bool> move_bytes{true};
  std::atomic<std::uint64_t> bytes_copied{0};

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
    pump();
  }
  //! Work queued on `s` and not run yet (held, or waiting).
  std::size_t queued_on(Stream s) const {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = queues_.find(s);
    return it == queues_.end() ? 0 : it->second.size();
  }
  //! The 64-bit value at `addr`, as the device sees it.
  std::uint64_t peek_value(const void* addr) const {
    std::lock_guard<std::mutex> lk(mu_);
    std::uint64_t v = 0;
    std::memcpy(&v, addr, sizeof v);
    return v;
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
  Status stream_destroy(Stream s) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = queues_.find(s);
      if (it != queues_.end() && !it->second.empty()) return violation("cudaStreamDestroy of a stream with work queued");
      queues_.erase(s);
    }
    return destroy(s);
  }
  Status stream_query(Stream s) override {
    std::lock_guard<std::mutex> lk(mu_);
    if (streams_hang) return kNotReady;
    auto it = queues_.find(s);
    return it != queues_.end() && !it->second.empty() ? kNotReady : kOk;
  }
  Status stream_wait_event(Stream s, Event e) override {
    if (Status r = use(e); r != kOk) return r;
    std::lock_guard<std::mutex> lk(mu_);
    if (s == nullptr) return kOk;  // the caller's "stream" in tests: host order already holds
    const FakeEvent& ev = events_[id_of(e) - 1];
    Work w;
    w.kind = Work::kWaitEvent;
    w.event = id_of(e);
    w.value = ev.recorded;  // bound to the most recent record at the time of the call
    return enqueue(s, w);
  }
  Status event_create(Event* e, bool interprocess) override { return *e = new_event(interprocess, false), kOk; }
  Status event_destroy(Event e) override { return destroy(e); }
  Status event_record(Event e, Stream s) override {
    if (Status r = use(e); r != kOk) return r;
    std::lock_guard<std::mutex> lk(mu_);
    FakeEvent& ev = events_[id_of(e) - 1];
    ++ev.recorded;
    if (s == nullptr) {  // the caller's stream in tests: nothing queued there
      ev.completed = ev.recorded;
      return kOk;
    }
    Work w;
    w.kind = Work::kRecord;
    w.event = id_of(e);
    w.value = ev.recorded;
    return enqueue(s, w);
  }
  Status event_query(Event e) override {
    if (Status r = use(e); r != kOk) return r;
    std::lock_guard<std::mutex> lk(mu_);
    const FakeEvent& ev = events_[id_of(e) - 1];
    return ev.completed >= ev.recorded ? kOk : kNotReady;
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
  Status memcpy_async(void* dst, const void* src, std::size_t bytes, CopyKind, Stream s) override {
    // Run under the fake's lock: the engines' host counters live in a segment
    // each maps at its own address, so ThreadSanitizer cannot see that they
    // order these copies.
    std::lock_guard<std::mutex> lk(mu_);
    Work w;
    w.kind = Work::kCopy;
    w.dst = dst;
    w.src = src;
    w.bytes = bytes;
    return enqueue(s, w);
  }
  Status stream_write_value(Stream s, void* addr, std::uint64_t value) override {
    std::lock_guard<std::mutex> lk(mu_);
    Work w;
    w.kind = Work::kWriteValue;
    w.dst = addr;
    w.value = value;
    ++signal_writes_;
    return enqueue(s, w);
  }
  Status stream_wait_value(Stream s, void* addr, std::uint64_t value) override {
    std::lock_guard<std::mutex> lk(mu_);
    Work w;
    w.kind = Work::kWaitValue;
    w.src = addr;
    w.value = value;
    ++signal_waits_;
    return enqueue(s, w);
  }
  Status set_value(void* addr, std::uint64_t value) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::memcpy(addr, &value, sizeof value);
    pump();
    return kOk;
  }
  std::string signal_mechanism() override { return "fake"; }
  std::uint64_t signal_writes() const {
    std::lock_guard<std::mutex> lk(mu_);
    return signal_writes_;
  }
  std::uint64_t signal_waits() const {
    std::lock_guard<std::mutex> lk(mu_);
    return signal_waits_;
  }
  std::uint64_t events_made() const {
    std::lock_guard<std::mutex> lk(mu_);
    return events_.size();
  }

 private:
  struct Alloc {
    std::size_t bytes = 0;
    int opened = 0;  // IPC mappings open on it
    std::uint64_t serial = 0;  // which allocation this is, should the address come back
  };
  struct FakeEvent {
    bool alive = true;
    std::uint64_t recorded = 0;   // records made
    std::uint64_t completed = 0;  // records the device has reached
  };
  struct Work {
    enum Kind { kCopy, kRecord, kWaitEvent, kWriteValue, kWaitValue } kind = kCopy;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
    std::size_t event = 0;
    std::uint64_t value = 0;
  };

  static std::size_t id_of(Event e) { return reinterpret_cast<std::size_t>(e); }

  Status enqueue(Stream s, const Work& w) {  // mu_ held
    queues_[s].push_back(w);
    pump();
    return kOk;
  }
  // Whether the head of a queue can run now (mu_ held).
  bool runnable(const Work& w) const {
    if (w.kind == Work::kWaitValue) {
      std::uint64_t v = 0;
      std::memcpy(&v, w.src, sizeof v);
      return reached(v, w.value);
    }
    if (w.kind == Work::kWaitEvent) return events_[w.event - 1].completed >= w.value;
    return true;
  }
  // Runs every stream as far as it can go (mu_ held).
  void pump() {
    bool moved = true;
    while (moved) {
      moved = false;
      for (auto& [s, q] : queues_) {
        if (std::find(held_.begin(), held_.end(), s) != held_.end()) continue;
        while (!q.empty() && runnable(q.front())) {
          const Work w = q.front();
          q.pop_front();
          moved = true;
          switch (w.kind) {
            case Work::kCopy:
              if (move_bytes) std::memcpy(w.dst, w.src, w.bytes);
              bytes_copied += w.bytes;
              break;
            case Work::kRecord: {
              FakeEvent& ev = events_[w.event - 1];
              ev.completed = std::max(ev.completed, w.value);
              break;
            }
            case Work::kWriteValue: std::memcpy(w.dst, &w.value, sizeof w.value); break;
            default: break;
          }
        }
      }
    }
  }

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
  std::map<Stream, std::deque<Work>> queues_;
  std::uint64_t signal_writes_ = 0;
  std::uint64_t signal_waits_ = 0;
  std::uint64_t serial_ = 0;
  std::vector<FakeEvent> events_;
  std::vector<std::size_t> malloc_sizes_;
  std::vector<std::string> violations_;
};

}  // namespace dualpipe::cuda::testing
