// The CUDA IPC engine's host protocol over a fake device (fake_device.h): two
// engines in this process (ranks 0 and 1) rendezvous through real shared
// segments and move bytes through the fake; runs under TSan and ASan in ctest.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/liveness.h"
#include "common/segment.h"
#include "cuda/ipc_engine.h"
#include "fake_device.h"

namespace dualpipe::cuda {
namespace {

using testing::FakeDevice;

bool listed(const std::string& name) {
  const std::string all = "\n" + list_segments() + "\n";
  return all.find("\n" + (name[0] == '/' ? name.substr(1) : name) + "\n") != std::string::npos;
}

EngineOptions small_options(Staging staging = Staging::kAuto) {
  EngineOptions o;
  o.num_slots = 3;
  o.slot_bytes = 64 << 10;
  o.staging = staging;
  o.direct_min_bytes = 256 << 10;
  return o;
}

//! Close both at once, as ranks do: neither may wait on the other.
void close_both(Engine& a, Engine& b, double timeout_s = 10.0) {
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

std::vector<char> pattern(std::size_t n, int seed) {
  std::vector<char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return v;
}

//! Device memory of the fake, filled from `v`.
char* device_copy(FakeDevice& dev, const std::vector<char>& v, std::size_t extra = 0) {
  void* p = nullptr;
  dev.malloc(&p, v.size() + extra);
  std::memcpy(static_cast<char*>(p) + extra, v.data(), v.size());
  return static_cast<char*>(p);
}

TEST(IpcEngine, SegmentsAreOursAndUnlinkedOnceBothSidesMapped) {
  auto dev = std::make_shared<FakeDevice>();
  Engine e0(dev, 0, 0, small_options());
  Engine e1(dev, 1, 0, small_options());
  const std::string name = e1.create_incoming(0);
  EXPECT_EQ(segment_creator_pid(name), static_cast<int>(::getpid())) << name << " must be sweepable";
  EXPECT_NE(name.find("cuda-0to1"), std::string::npos) << name;
  EXPECT_TRUE(listed(name));
  e0.attach_outgoing(1, name);
  EXPECT_FALSE(listed(name)) << "the sender unlinks the name once it has mapped it";
  e1.finish_incoming(0);
  close_both(e0, e1);
  EXPECT_TRUE(dev->violations().empty()) << dev->violations().front();
  EXPECT_EQ(dev->live_allocations(), 0u);
}

TEST(IpcEngine, StagedMessagesBothWaysByteExact) {
  Pair p;
  for (int k = 0; k < 12; ++k) {
    const std::size_t n = static_cast<std::size_t>(k * 50021 % 200000 + (k % 3));
    const auto a = pattern(n, k), b = pattern(n, 100 + k);
    std::vector<char> ra(n), rb(n);
    auto r1 = p.e1->post(OpKind::kRecv, 0, k, ra.data(), n, "Float", nullptr, nullptr);
    auto r0 = p.e0->post(OpKind::kRecv, 1, k, rb.data(), n, "Float", nullptr, nullptr);
    auto s0 = p.e0->post(OpKind::kSend, 1, k, const_cast<char*>(a.data()), n, "Float", nullptr, nullptr);
    auto s1 = p.e1->post(OpKind::kSend, 0, k, const_cast<char*>(b.data()), n, "Float", nullptr, nullptr);
    for (auto* op : {&s0, &s1, &r0, &r1}) ASSERT_TRUE((*op)->wait(10.0)) << (*op)->describe();
    EXPECT_EQ(ra, a);
    EXPECT_EQ(rb, b);
  }
  EXPECT_EQ(p.e0->stats().staged_sends, 12u);
  EXPECT_EQ(p.e1->stats().staged_recvs, 12u);
  EXPECT_EQ(p.e0->channel_staging(1, true), "ipc");
}

TEST(IpcEngine, ZeroCopySendOfAViewAtAnOffset) {
  Pair p;
  const std::size_t n = 1 << 20, offset = 4096 + 256;
  const auto a = pattern(n, 3);
  char* base = device_copy(*p.dev, a, offset);
  EXPECT_EQ(p.transfer(7, base + offset, n, base), a);
  EXPECT_TRUE(p.last_send_zero_copy);
  const EngineStats st0 = p.e0->stats(), st1 = p.e1->stats();
  EXPECT_EQ(st0.zero_copy_sends, 1u);
  EXPECT_EQ(st0.mem_handle_exports, 1u);
  EXPECT_EQ(st1.zero_copy_recvs, 1u);
  EXPECT_EQ(st1.peer_mappings_opened, 1u);
  close_both(*p.e0, *p.e1);  // e1 closes its mapping of `base` before base is freed
  EXPECT_EQ(p.dev->free(base), kOk) << "the receiver must have closed its mapping at close";
}

TEST(IpcEngine, ZeroCopySizeMismatchFailsOnlyThatReceive) {
  Pair p;
  const std::size_t n = 512 << 10;
  const auto a = pattern(n, 4);
  char* base = device_copy(*p.dev, a);
  std::vector<char> small(n / 2);
  auto bad = p.e1->post(OpKind::kRecv, 0, 1, small.data(), small.size(), "Float", nullptr, nullptr);
  auto s = p.e0->post(OpKind::kSend, 1, 1, base, n, "Float", nullptr, nullptr, base);
  EXPECT_THROW(bad->wait(10.0), std::runtime_error);
  EXPECT_NE(bad->error().find("zero-copy"), std::string::npos) << bad->error();
  ASSERT_TRUE(s->wait(10.0));
  EXPECT_EQ(p.transfer(2, base, n, base), a) << "the channel goes on";
  close_both(*p.e0, *p.e1);
  EXPECT_EQ(p.dev->free(base), kOk);
}

//! The last reference to a buffer of the fake device: dropping it frees the
//! allocation, as torch's caching allocator may cudaFree a released segment
//! (its OOM retry frees cached segments).
std::shared_ptr<void> owned_by_tensor(const std::shared_ptr<FakeDevice>& dev, char* p) {
  return std::shared_ptr<void>(p, [dev](void* q) { dev->free(q); });
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

TEST(FakeDevice, DetectsAFreeWhileMappedAndAStaleHandle) {
  FakeDevice dev;
  void* p = nullptr;
  dev.malloc(&p, 4096);
  IpcMemHandle h{};
  ASSERT_EQ(dev.ipc_get_mem_handle(&h, p), kOk);
  void* mapped = nullptr;
  ASSERT_EQ(dev.ipc_open_mem_handle(&mapped, h), kOk);
  EXPECT_NE(dev.free(p), kOk);
  ASSERT_EQ(dev.violations().size(), 1u);
  EXPECT_NE(dev.violations()[0].find("cudaFree while another side still maps"), std::string::npos);
  ASSERT_EQ(dev.ipc_close_mem_handle(mapped), kOk);
  ASSERT_EQ(dev.free(p), kOk);
  void* again = nullptr;
  dev.malloc(&again, 4096);
  EXPECT_EQ(again, p) << "a freed block comes back for the same size, as from a caching allocator";
  EXPECT_NE(dev.ipc_open_mem_handle(&mapped, h), kOk);
  EXPECT_NE(dev.violations().back().find("stale handle"), std::string::npos);
  dev.free(again);
}

// Item 9: the caller drops its tensor as soon as the send completes; the
// allocator would free the segment at once. The receiver still maps it (its
// mapping cache), so the sender must keep the allocation alive until the
// receiver says it unmapped it. Before the export table this freed the
// allocation under the receiver's mapping (a "cudaFree while another side
// still maps" violation at the first transfer).
TEST(IpcEngine, ASentAllocationStaysAliveWhileTheReceiverMapsIt) {
  EngineOptions o = small_options();
  o.max_peer_mappings = 2;
  Pair p(o);
  const std::size_t n = 256 << 10;
  std::vector<char*> bufs;
  for (int i = 0; i < 3; ++i) bufs.push_back(device_copy(*p.dev, pattern(n, i)));
  EXPECT_EQ(p.transfer(0, bufs[0], n, bufs[0], owned_by_tensor(p.dev, bufs[0])), pattern(n, 0));
  EXPECT_TRUE(p.last_send_zero_copy);
  // The worker drops the op's reference after the iteration that completed
  // it; a later transfer completes in a later iteration.
  const auto small = pattern(1000, 5);
  EXPECT_EQ(p.transfer(9, small.data(), small.size()), small);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
  EXPECT_TRUE(p.dev->is_allocated(bufs[0])) << "freed although the receiver still maps it";
  EXPECT_EQ(p.dev->mappings_of(bufs[0]), 1);
  // A second allocation takes the second export entry; a third finds both in
  // use: the sender asks the receiver to unmap the least recently used one
  // (bufs[0]) and sends this one through the ring meanwhile.
  EXPECT_EQ(p.transfer(1, bufs[1], n, bufs[1], owned_by_tensor(p.dev, bufs[1])), pattern(n, 1));
  EXPECT_EQ(p.transfer(2, bufs[2], n, bufs[2], owned_by_tensor(p.dev, bufs[2])), pattern(n, 2));
  EXPECT_FALSE(p.last_send_zero_copy) << "no export entry free yet: staged";
  EXPECT_EQ(p.e0->stats().zero_copy_deferred, 1u);
  ASSERT_TRUE(eventually([&] { return p.dev->mappings_of(bufs[0]) == 0; })) << "the receiver unmaps on request";
  // The sender's worker polls for that unmap, then drops its keep-alive (no
  // further transfer needed).
  ASSERT_TRUE(eventually([&] { return !p.dev->is_allocated(bufs[0]); })) << "released once unmapped";
  EXPECT_EQ(p.e0->stats().exports_released, 1u);
  EXPECT_TRUE(p.dev->is_allocated(bufs[1])) << "still mapped by the receiver";
  EXPECT_TRUE(eventually([&] { return !p.dev->is_allocated(bufs[2]); })) << "a staged send holds its buffer no longer";
  close_both(*p.e0, *p.e1);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
  EXPECT_FALSE(p.dev->is_allocated(bufs[1])) << "close releases every keep-alive once the receiver detached";
  EXPECT_EQ(p.dev->open_mappings(), 0);
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

TEST(IpcEngine, WithOneMappingAllocationsTakeTurnsAndNoneIsFreedMapped) {
  EngineOptions o = small_options();
  o.max_peer_mappings = 1;
  Pair p(o);
  const std::size_t n = 256 << 10;
  std::vector<char*> bufs;
  for (int i = 0; i < 6; ++i) bufs.push_back(device_copy(*p.dev, pattern(n, i), i * 4096));  // distinct sizes
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(p.transfer(i, bufs[i] + i * 4096, n, bufs[i], owned_by_tensor(p.dev, bufs[i])), pattern(n, i));
  }
  // Never more than one allocation mapped; those not mapped any more are freed.
  EXPECT_TRUE(kick_until(p, [&] { return p.dev->open_mappings() <= 3; }));  // both rings + at most one buffer
  const EngineStats s0 = p.e0->stats(), s1 = p.e1->stats();
  EXPECT_EQ(s0.zero_copy_sends + s0.zero_copy_deferred, 6u);
  EXPECT_GE(s0.zero_copy_sends, 2u) << "an entry freed by the receiver serves a later allocation";
  EXPECT_EQ(s1.peer_mappings_opened, s0.zero_copy_sends);
  EXPECT_EQ(s0.mem_handle_exports, s0.zero_copy_sends);
  close_both(*p.e0, *p.e1);
  for (char* b : bufs) EXPECT_FALSE(p.dev->is_allocated(b)) << "every keep-alive is dropped at close";
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

// Item 10: one cudaIpcGetMemHandle per allocation, however many sends (and
// views at whatever offsets) go out of it.
TEST(IpcEngine, TheHandleIsMadeOncePerAllocation) {
  Pair p;
  const std::size_t n = 256 << 10, views = 4;
  std::vector<char> all;
  for (std::size_t v = 0; v < views; ++v) {
    const auto part = pattern(n, static_cast<int>(v));
    all.insert(all.end(), part.begin(), part.end());
  }
  char* base = device_copy(*p.dev, all);
  auto tensor = owned_by_tensor(p.dev, base);
  const int before = p.dev->get_mem_handle_calls.load();
  for (int k = 0; k < 20; ++k) {
    const std::size_t v = static_cast<std::size_t>(k) % views;
    EXPECT_EQ(p.transfer(k, base + v * n, n, base, tensor), pattern(n, static_cast<int>(v)));
    EXPECT_TRUE(p.last_send_zero_copy);
  }
  tensor.reset();
  EXPECT_TRUE(kick_until(p, [&] { return p.dev->is_allocated(base); })) << "the export entry holds it";
  EXPECT_EQ(p.dev->get_mem_handle_calls.load() - before, 1);
  EXPECT_EQ(p.e0->stats().mem_handle_exports, 1u);
  EXPECT_EQ(p.e1->stats().peer_mappings_opened, 1u);
  close_both(*p.e0, *p.e1);
  EXPECT_FALSE(p.dev->is_allocated(base));
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

// A released allocation whose address comes back as a new allocation gets a
// new handle: the cached one went with the keep-alive (a stale handle would
// map the old allocation, which the fake reports).
TEST(IpcEngine, AFreedAndReallocatedAddressNeverReusesAStaleHandle) {
  EngineOptions o = small_options();
  o.max_peer_mappings = 1;
  Pair p(o);
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 1));
  EXPECT_EQ(p.transfer(1, x, n, x, owned_by_tensor(p.dev, x)), pattern(n, 1));
  char* y = device_copy(*p.dev, pattern(n, 2), 4096);  // another size: not handed x's address later
  EXPECT_EQ(p.transfer(2, y + 4096, n, y, owned_by_tensor(p.dev, y)), pattern(n, 2));  // staged; x is retired
  ASSERT_TRUE(kick_until(p, [&] { return !p.dev->is_allocated(x); }));
  const int before = p.dev->get_mem_handle_calls.load();
  char* z = device_copy(*p.dev, pattern(n, 3));
  ASSERT_EQ(z, x) << "the fake hands a freed block out again for the same size";
  EXPECT_EQ(p.transfer(3, z, n, z, owned_by_tensor(p.dev, z)), pattern(n, 3));
  EXPECT_TRUE(p.last_send_zero_copy);
  EXPECT_EQ(p.dev->get_mem_handle_calls.load() - before, 1) << "a new allocation needs a new handle";
  close_both(*p.e0, *p.e1);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

// Item 10: unmapping waits for the copies that read the mapping through an
// event, never with a host wait under the engine lock. Here the receiver's
// copies do not finish (its receive stream is held): the unmap stays pending,
// and meanwhile both engines still accept and move other transfers.
TEST(IpcEngine, APendingUnmapDoesNotHoldTheEngine) {
  EngineOptions o = small_options();
  o.max_peer_mappings = 1;
  Pair p(o);
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 1));
  char* y = device_copy(*p.dev, pattern(n, 2), 4096);
  EXPECT_EQ(p.transfer(1, x, n, x, owned_by_tensor(p.dev, x)), pattern(n, 1));
  const Stream held = p.e1->stream_for(OpKind::kRecv);
  p.dev->hold_stream(held);
  std::vector<char> out(n);
  auto r = p.e1->post(OpKind::kRecv, 0, 2, out.data(), n, "Float", nullptr, nullptr);
  auto s = p.e0->post(OpKind::kSend, 1, 2, y + 4096, n, "Float", nullptr, owned_by_tensor(p.dev, y), y);
  ASSERT_TRUE(r->wait_stream(nullptr, 5.0)) << r->describe();  // enqueued: the retire of x is being served
  EXPECT_FALSE(r->query()) << "its copy is held";
  EXPECT_EQ(p.e0->stats().zero_copy_deferred, 1u);
  // Another thread posts on the receiver's engine (a send back to rank 0) and
  // it completes, while the unmap of x still waits for the held stream.
  const auto back = pattern(100000, 7);
  std::vector<char> got(back.size());
  bool sent = false;
  std::thread t([&] {
    auto s1 = p.e1->post(OpKind::kSend, 0, 3, const_cast<char*>(back.data()), back.size(), "Float", nullptr, nullptr);
    sent = s1->wait(5.0);
  });
  auto r0 = p.e0->post(OpKind::kRecv, 1, 3, got.data(), got.size(), "Float", nullptr, nullptr);
  EXPECT_TRUE(r0->wait(5.0)) << r0->describe();
  t.join();
  EXPECT_TRUE(sent);
  EXPECT_EQ(got, back);
  EXPECT_EQ(p.dev->mappings_of(x), 1) << "unmapped before the copies reading it finished";
  p.dev->release_stream(held);
  EXPECT_TRUE(r->wait(5.0));
  EXPECT_EQ(out, pattern(n, 2));
  EXPECT_TRUE(s->wait(5.0));
  EXPECT_TRUE(kick_until(p, [&] { return !p.dev->is_allocated(x); }));
  close_both(*p.e0, *p.e1);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

// A receiver that abandons its mappings at close (its copies did not drain)
// may still map the sender's allocations: the sender's close keeps them.
TEST(IpcEngine, KeepAlivesOutliveCloseWhenTheReceiverAbandons) {
  Pair p;
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 1));
  EXPECT_EQ(p.transfer(1, x, n, x, owned_by_tensor(p.dev, x)), pattern(n, 1));
  p.dev->streams_hang = true;
  p.e1->close(0.2);  // abandons: its mapping of x stays
  p.dev->streams_hang = false;
  p.e0->close(5.0);
  EXPECT_TRUE(p.dev->is_allocated(x)) << "freed under the receiver's abandoned mapping";
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
  EXPECT_EQ(p.dev->mappings_of(x), 1);
  // The engine holds it until it is destroyed; this test's fake stops checking here.
  p.dev->ipc_close_mem_handle(x);
}

TEST(IpcEngine, HostStagingMovesBytes) {
  Pair p(small_options(Staging::kHost));
  EXPECT_EQ(p.e0->channel_staging(1, true), "host");
  const auto a = pattern(300000, 9);
  EXPECT_EQ(p.transfer(5, a.data(), a.size()), a);
}

TEST(IpcEngine, SmallRingsAreRoundedUpToTwoMiB) {
  Pair p;  // 3 x 64 KiB slots
  const auto sizes = p.dev->malloc_sizes();
  ASSERT_EQ(sizes.size(), 2u);
  for (std::size_t s : sizes) EXPECT_EQ(s, kRingAlignment);
}

TEST(IpcEngine, EventExportFailureFallsBackToHostStagingUnderAuto) {
  auto dev = std::make_shared<FakeDevice>();
  dev->fail_get_event_handle = true;
  Engine e0(dev, 0, 0, small_options(Staging::kAuto));
  Engine e1(dev, 1, 0, small_options(Staging::kAuto));
  e0.attach_outgoing(1, e1.create_incoming(0));
  e1.finish_incoming(0);
  EXPECT_EQ(e1.channel_staging(0, false), "host");
  Engine strict(dev, 2, 0, small_options(Staging::kIpc));
  EXPECT_THROW(strict.create_incoming(0), IpcUnavailable);
  close_both(e0, e1);
  EXPECT_EQ(dev->live_allocations(), 0u);
}

TEST(IpcEngine, PeerCannotOpenTheRingIsACatchableIpcUnavailable) {
  auto dev = std::make_shared<FakeDevice>();
  Engine e0(dev, 0, 0, small_options());
  Engine e1(dev, 1, 0, small_options());
  const std::string name = e1.create_incoming(0);
  dev->fail_open_mem_handle = true;
  EXPECT_THROW(e0.attach_outgoing(1, name), IpcUnavailable);
  dev->fail_open_mem_handle = false;
  dev->fail_open_event_handle = true;
  Engine e2(dev, 2, 0, small_options());
  EXPECT_THROW(e2.attach_outgoing(1, e1.create_incoming(2)), std::runtime_error);
  e0.close(1.0);
  e1.close(1.0);
  e2.close(1.0);
  EXPECT_FALSE(listed(name));
  EXPECT_EQ(dev->open_mappings(), 0);
  EXPECT_EQ(dev->live_allocations(), 0u);
}

TEST(IpcEngine, ExporterClosingFirstLeaksRatherThanFreesUnderALivePeer) {
  Pair p;
  const auto start = std::chrono::steady_clock::now();
  p.e1->close(0.2);  // e0 still maps e1's ring and events and has not detached
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_GE(p.e1->stats().exports_leaked, 1u);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

TEST(IpcEngine, ClosingTogetherFreesEverythingPromptly) {
  auto dev = std::make_shared<FakeDevice>();
  {
    Pair p;
    dev = p.dev;
    const auto start = std::chrono::steady_clock::now();
    std::thread t([&] { p.e1->close(20.0); });
    p.e0->close(20.0);
    t.join();
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "closing must not wait out timeouts";
    EXPECT_EQ(p.e0->stats().exports_leaked + p.e1->stats().exports_leaked, 0u);
  }
  EXPECT_TRUE(dev->violations().empty()) << dev->violations().front();
  EXPECT_EQ(dev->live_allocations(), 0u);
  EXPECT_EQ(dev->open_mappings(), 0);
}

TEST(IpcEngine, HungStreamsAbandonAndThePeerLeaksPromptly) {
  Pair p;
  p.dev->streams_hang = true;
  const auto start = std::chrono::steady_clock::now();
  p.e0->close(0.2);  // publishes kAbandoned: its copies may still read e1's memory
  p.dev->streams_hang = false;
  p.e1->close(20.0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5)) << "kAbandoned ends the peer's wait";
  EXPECT_GE(p.e1->stats().exports_leaked, 1u);
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

TEST(IpcEngine, HungStreamsKeepAHostRingMappedUntilTheEngineGoes) {
  Pair p(small_options(Staging::kHost));
  const auto a = pattern(100000, 11);
  EXPECT_EQ(p.transfer(3, a.data(), a.size()), a);
  p.dev->streams_hang = true;
  close_both(*p.e0, *p.e1, 0.2);  // both abandon: nothing freed or unmapped under a copy
  p.dev->streams_hang = false;
  EXPECT_TRUE(p.dev->violations().empty()) << p.dev->violations().front();
}

TEST(IpcEngine, SegmentOfAKilledCreatorIsSweptByTheNextClose) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    auto dev = std::make_shared<FakeDevice>();
    Engine e(dev, 1, 0, small_options());
    const std::string name = e.create_incoming(0);
    (void)!::write(fds[1], name.c_str(), name.size() + 1);
    ::raise(SIGKILL);  // killed mid-rendezvous: nobody mapped the segment yet
  }
  ::close(fds[1]);
  char buf[256] = {};
  ASSERT_GT(::read(fds[0], buf, sizeof buf - 1), 0);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  const std::string name = buf;  // left behind (unless a concurrent test's engine swept it already)
  // A legacy-named segment (older builds: "/dpk_cuda_<pid>_...") of the dead child is swept too.
  const std::string legacy = "/dpk_cuda_" + std::to_string(child) + "_0to1_test";
  const int fd = ::shm_open(legacy.c_str(), O_CREAT | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ::close(fd);
  auto dev = std::make_shared<FakeDevice>();
  Engine e(dev, 0, 0, small_options());
  e.close(1.0);
  EXPECT_FALSE(listed(name));
  EXPECT_FALSE(listed(legacy));
}

TEST(Liveness, AZombieCountsAsDead) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  std::string why;
  for (int i = 0; i < 2000 && why.empty(); ++i) {  // not reaped: a zombie once it has exited
    why = process_dead_reason(child);
    if (why.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(why, "exited (zombie)");
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(process_dead_reason(child), "exited");
  EXPECT_EQ(process_dead_reason(static_cast<int>(::getpid())), "");
}

}  // namespace
}  // namespace dualpipe::cuda
