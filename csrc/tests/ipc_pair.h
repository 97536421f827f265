// Helpers of the CUDA IPC engine's unit tests: two engines (ranks 0 and 1)
// wired both ways over one fake device (fake_device.h), and payloads.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda/ipc_engine.h"
#include "fake_device.h"

namespace dualpipe::cuda::testing {

inline EngineOptions small_options(Staging staging = Staging::kAuto) {
  EngineOptions o;
  o.num_slots = 3;
  o.slot_bytes = 64 << 10;
  o.staging = staging;
  o.direct_min_bytes = 256 << 10;
  return o;
}

//! small_options() with at most `max_peer_mappings` of the sender's allocations mapped per peer.
inline EngineOptions mapping_options(int max_peer_mappings) {
  EngineOptions o = small_options();
  o.max_peer_mappings = max_peer_mappings;
  return o;
}

//! Success when the fake device saw no violation; else a failure naming the first one.
inline ::testing::AssertionResult no_violations(const FakeDevice& dev) {
  const std::vector<std::string> v = dev.violations();
  if (v.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << v.front();
}

//! Close both at once, as ranks do: neither may wait on the other.
inline void close_both(Engine& a, Engine& b, double timeout_s = 10.0) {
  std::thread t([&] { b.close(timeout_s); });
  a.close(timeout_s);
  t.join();
}

//! Two engines wired both ways, as CudaIpcTransport's rendezvous does it.
struct Pair {
  std::shared_ptr<FakeDevice> dev = std::make_shared<FakeDevice>();
  std::unique_ptr<Engine> e0, e1;
  std::string to0, to1;  // segment names (already unlinked after attach)

  explicit Pair(const EngineOptions& o = small_options()) {
    e0 = std::make_unique<Engine>(dev, 0, 0, o);
    e1 = std::make_unique<Engine>(dev, 1, 0, o);
    to1 = e1->create_incoming(0);
    to0 = e0->create_incoming(1);
    e0->attach_outgoing(1, to1);
    e1->attach_outgoing(0, to0);
    e0->finish_incoming(1);
    e1->finish_incoming(0);
  }
  ~Pair() { close_both(*e0, *e1); }

  //! Rank 0 sends `n` bytes at `src` (inside the allocation `base`, or host memory if null);
  //! rank 1 receives them. Returns what arrived; the test fails if either side does not finish.
  //! `keep` stands for the sender's tensor: the engine's reference to it.
  std::vector<char> transfer(std::int64_t tag, const char* src, std::size_t n, char* base = nullptr,
                             std::shared_ptr<void> keep = nullptr) {
    std::vector<char> out(n);
    auto r = e1->post(OpKind::kRecv, 0, tag, out.data(), n, "Float", nullptr, nullptr);
    auto s = e0->post(OpKind::kSend, 1, tag, const_cast<char*>(src), n, "Float", nullptr, std::move(keep), base);
    EXPECT_TRUE(s->wait(10.0)) << s->describe();
    EXPECT_TRUE(r->wait(10.0)) << r->describe();
    last_send_zero_copy = s->zero_copy();
    return out;
  }
  bool last_send_zero_copy = false;
};

inline std::vector<char> pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return v;
}

//! Device memory of the fake, filled from `v`.
inline char* device_copy(FakeDevice& dev, const std::vector<char>& v, std::size_t extra = 0) {
  void* p = nullptr;
  dev.malloc(&p, v.size() + extra);
  std::memcpy(static_cast<char*>(p) + extra, v.data(), v.size());
  return static_cast<char*>(p);
}

//! The last reference to a buffer of the fake device: dropping it frees the
//! allocation, as torch's caching allocator may cudaFree a released segment
//! (its OOM retry frees cached segments).
inline std::shared_ptr<void> owned_by_tensor(const std::shared_ptr<FakeDevice>& dev, char* p) {
  return std::shared_ptr<void>(p, [dev](void* q) { dev->free(q); });
}

//! Closes both engines of `p` (as close_both), then no_violations of its fake device.
inline ::testing::AssertionResult closed_cleanly(Pair& p) {
  close_both(*p.e0, *p.e1);
  return no_violations(*p.dev);
}

//! Rank 0 sends the first `n` bytes of the device allocation `base` as a tensor that is the allocation's
//! last owner (see owned_by_tensor); returns what rank 1 received.
inline std::vector<char> transfer_owned(Pair& p, std::int64_t tag, char* base, std::size_t n) {
  return p.transfer(tag, base, n, base, owned_by_tensor(p.dev, base));
}

//! Polls `done` for up to 5 s.
template <class F>
bool eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

//! Small staged transfers until `done` (each one runs both workers once more).
template <class F>
bool kick_until(Pair& p, F done) {
  const auto small = pattern(512, 1);
  for (int i = 0; i < 500 && !done(); ++i) {
    if (p.transfer(1000 + i, small.data(), small.size()) != small) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return done();
}

}  // namespace dualpipe::cuda::testing
