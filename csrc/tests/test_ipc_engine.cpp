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
#include "ipc_pair.h"

namespace dualpipe::cuda {
namespace {

using namespace testing;  // NOLINT: the fake device and the pair helpers

bool listed(const std::string& name) {
  const std::string all = "\n" + list_segments() + "\n";
  return all.find("\n" + (name[0] == '/' ? name.substr(1) : name) + "\n") != std::string::npos;
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
  EXPECT_TRUE(no_violations(*dev));
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

TEST(IpcEngine, HostStagingMovesBytes) {
  Pair p(small_options(Staging::kHost));
  EXPECT_EQ(p.e0->channel_staging(1, true), "host");
  const auto a = pattern(300000, 9);
  EXPECT_EQ(p.transfer(5, a.data(), a.size()), a);
}

TEST(IpcEngine, BorrowedStreamsOutliveTheEngine) {
  // A caching allocator records freed buffers on the comm streams: streams the
  // caller lends (torch's pool in the bindings) must still be alive after close.
  auto dev = std::make_shared<FakeDevice>();
  EngineOptions o = small_options();
  ASSERT_EQ(dev->stream_create(&o.send_stream), kOk);
  ASSERT_EQ(dev->stream_create(&o.recv_stream), kOk);
  ASSERT_EQ(dev->stream_create(&o.done_stream), kOk);
  {
    Engine e0(dev, 0, 0, o);
    Engine e1(dev, 1, 0, o);
    e0.attach_outgoing(1, e1.create_incoming(0));
    e1.attach_outgoing(0, e0.create_incoming(1));
    e0.finish_incoming(1);
    e1.finish_incoming(0);
    EXPECT_EQ(e0.stream_for(OpKind::kSend), o.send_stream);
    EXPECT_EQ(e0.stream_for(OpKind::kRecv), o.recv_stream);
    close_both(e0, e1);
  }
  EXPECT_EQ(dev->stream_query(o.send_stream), kOk) << "a borrowed stream was destroyed";
  EXPECT_EQ(dev->stream_destroy(o.send_stream), kOk);
  EXPECT_EQ(dev->stream_destroy(o.recv_stream), kOk);
  EXPECT_EQ(dev->stream_destroy(o.done_stream), kOk);
  EXPECT_TRUE(no_violations(*dev));

  EngineOptions one = small_options();
  one.send_stream = o.send_stream;
  EXPECT_THROW(Engine(dev, 0, 0, one), std::invalid_argument) << "one borrowed stream without the others";
  one.recv_stream = o.send_stream;
  one.done_stream = o.recv_stream;
  EXPECT_THROW(Engine(dev, 0, 0, one), std::invalid_argument) << "the same stream for two roles";
}

TEST(IpcEngine, SmallRingsAreRoundedUpToTwoMiB) {
  Pair p;  // 3 x 64 KiB slots
  const auto sizes = p.dev->malloc_sizes();
  ASSERT_EQ(sizes.size(), 2u);
  for (std::size_t s : sizes) EXPECT_EQ(s, kRingAlignment);
}

TEST(IpcEngine, RingExportFailureFallsBackToHostStagingUnderAuto) {
  auto dev = std::make_shared<FakeDevice>();
  dev->fail_get_mem_handle = true;
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
  e0.close(1.0);
  e1.close(1.0);
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
  EXPECT_TRUE(no_violations(*p.dev));
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
  EXPECT_TRUE(no_violations(*dev));
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
  EXPECT_TRUE(no_violations(*p.dev));
}

TEST(IpcEngine, HungStreamsKeepAHostRingMappedUntilTheEngineGoes) {
  Pair p(small_options(Staging::kHost));
  const auto a = pattern(100000, 11);
  EXPECT_EQ(p.transfer(3, a.data(), a.size()), a);
  p.dev->streams_hang = true;
  close_both(*p.e0, *p.e1, 0.2);  // both abandon: nothing freed or unmapped under a copy
  p.dev->streams_hang = false;
  EXPECT_TRUE(no_violations(*p.dev));
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
