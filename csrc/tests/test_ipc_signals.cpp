// The CUDA IPC engine's device-side signalling over the fake device: the
// streams write and await the ready/freed counters themselves, chunk numbers
// wrap around 2^64, a peer that dies between a signal write and the wait for
// it, close with messages in flight, and a slow receiver holding the sender
// at the in-flight limit.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "cuda/fake_bench.h"
#include "ipc_pair.h"

namespace dualpipe::cuda::testing {
namespace {

using Clock = std::chrono::steady_clock;

//! Two engines wired both ways; each may see its peer as dead once `*_dead` is set.
struct DyingPair {
  std::shared_ptr<FakeDevice> dev = std::make_shared<FakeDevice>();
  std::atomic<bool> e0_sees_peer_dead{false}, e1_sees_peer_dead{false};
  std::unique_ptr<Engine> e0, e1;

  explicit DyingPair(EngineOptions o = small_options()) {
    EngineOptions o0 = o, o1 = o;
    o0.peer_dead_reason = [this](int) { return e0_sees_peer_dead ? std::string("killed by the test") : ""; };
    o1.peer_dead_reason = [this](int) { return e1_sees_peer_dead ? std::string("killed by the test") : ""; };
    e0 = std::make_unique<Engine>(dev, 0, 0, o0);
    e1 = std::make_unique<Engine>(dev, 1, 0, o1);
    const std::string to1 = e1->create_incoming(0), to0 = e0->create_incoming(1);
    e0->attach_outgoing(1, to1);
    e1->attach_outgoing(0, to0);
    e0->finish_incoming(1);
    e1->finish_incoming(0);
  }
  ~DyingPair() { close_both(*e0, *e1, 2.0); }
};

//! Runs `f` and returns its exception's message ("" if it did not throw).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

TEST(IpcSignals, StreamsSignalEachOtherWithNoEventPerMessage) {
  Pair p;
  const auto a = pattern(1000, 1);
  const auto big = pattern(300000, 2);  // 5 chunks of 64 KiB through a 3-slot ring
  EXPECT_EQ(p.transfer(1, a.data(), a.size()), a);
  const std::uint64_t events = p.e0->stats().events_created + p.e1->stats().events_created;
  const std::uint64_t made = p.dev->events_made();
  for (int i = 0; i < 200; ++i) ASSERT_EQ(p.transfer(2 + i, a.data(), a.size()), a);
  for (int i = 0; i < 10; ++i) ASSERT_EQ(p.transfer(500 + i, big.data(), big.size()), big);
  EXPECT_EQ(p.e0->stats().events_created + p.e1->stats().events_created, events) << "events made per message";
  EXPECT_EQ(p.dev->events_made(), made);
  // every chunk: one ready write by the sender's stream, one wait and one freed write by the receiver's
  EXPECT_GE(p.dev->signal_writes(), 2u * (201 + 50));
  EXPECT_GE(p.e1->stats().stream_waits, 201u + 50u);
  EXPECT_TRUE(closed_cleanly(p));
}

TEST(IpcSignals, CountersWrapAround) {
  EngineOptions o = small_options();
  o.counter_base = std::numeric_limits<std::uint64_t>::max() - 5;
  Pair p(o);
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 3));
  for (int i = 0; i < 6; ++i) {
    const auto a = pattern(1000 + 100 * i, i);
    ASSERT_EQ(p.transfer(i, a.data(), a.size()), a) << "message " << i;
  }
  const auto big = pattern(200000, 9);  // 4 chunks, across the wrap
  EXPECT_EQ(p.transfer(10, big.data(), big.size()), big);
  EXPECT_EQ(p.transfer(11, x, n, x), pattern(n, 3));
  EXPECT_TRUE(p.last_send_zero_copy);
  for (int i = 0; i < 6; ++i) {
    const auto a = pattern(5000, 20 + i);
    ASSERT_EQ(p.transfer(20 + i, a.data(), a.size()), a) << "message after the wrap " << i;
  }
  const auto [published, taken] = p.e1->host_counters(0, false);
  EXPECT_EQ(published, taken);
  EXPECT_EQ(published, 11u) << "17 chunks (6 + 4 + 1 + 6) from 2^64 - 6 end at 11";
  EXPECT_TRUE(closed_cleanly(p));
  p.dev->free(x);
}

TEST(IpcSignals, LaterSendsDoNotQueueBehindADoneWait) {
  Pair p;
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 4));
  const Stream held = p.e1->stream_for(OpKind::kRecv);
  p.dev->hold_stream(held);  // the receiver's copies (and its freed signal) do not run yet
  std::vector<char> out(n), out2(1000);
  auto r = p.e1->post(OpKind::kRecv, 0, 1, out.data(), n, "Float", nullptr, nullptr);
  auto s = p.e0->post(OpKind::kSend, 1, 1, x, n, "Float", nullptr, nullptr, x);
  const auto small = pattern(1000, 5);
  auto r2 = p.e1->post(OpKind::kRecv, 0, 2, out2.data(), out2.size(), "Float", nullptr, nullptr);
  auto s2 = p.e0->post(OpKind::kSend, 1, 2, const_cast<char*>(small.data()), small.size(), "Float", nullptr, nullptr);
  ASSERT_TRUE(s2->wait(5.0)) << s2->describe() << ": a staged send queued behind a zero-copy send's done-wait";
  ASSERT_TRUE(s->wait_stream(nullptr, 5.0));
  EXPECT_TRUE(s->zero_copy());
  EXPECT_FALSE(s->query()) << "done before the receiver copied out of the buffer";
  p.dev->release_stream(held);
  EXPECT_TRUE(s->wait(5.0));
  EXPECT_TRUE(r->wait(5.0));
  EXPECT_TRUE(r2->wait(5.0));
  EXPECT_EQ(out, pattern(n, 4));
  EXPECT_EQ(out2, small);
  EXPECT_TRUE(closed_cleanly(p));
  p.dev->free(x);
}

TEST(IpcSignals, SenderDyingBetweenItsWriteAndTheReceiversWaitFailsTheReceive) {
  DyingPair p;
  const Stream sender = p.e0->stream_for(OpKind::kSend);
  p.dev->hold_stream(sender);  // the copy into the ring and the ready write are enqueued, never run
  std::vector<char> out(1000);
  const auto a = pattern(1000, 6);
  auto r = p.e1->post(OpKind::kRecv, 0, 1, out.data(), out.size(), "Float", nullptr, nullptr);
  auto s = p.e0->post(OpKind::kSend, 1, 1, const_cast<char*>(a.data()), a.size(), "Float", nullptr, nullptr);
  ASSERT_TRUE(r->wait_stream(nullptr, 5.0)) << r->describe();  // enqueued: its stream waits for `ready`
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(r->query());
  EXPECT_GT(p.dev->queued_on(p.e1->stream_for(OpKind::kRecv)), 0u);
  const auto t0 = Clock::now();
  p.e1_sees_peer_dead = true;
  const std::string err = error_of([&] { r->wait(5.0); });
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_NE(err.find("peer 0"), std::string::npos) << err;
  EXPECT_NE(err.find("died"), std::string::npos) << err;
  EXPECT_TRUE(eventually([&] { return p.dev->queued_on(p.e1->stream_for(OpKind::kRecv)) == 0; }))
      << "the receive stream still waits for the dead sender";
  EXPECT_EQ(p.e1->stats().peers_died, 1u);
  // later posts to the dead peer fail at once, naming it
  auto again = p.e1->post(OpKind::kRecv, 0, 2, out.data(), out.size(), "Float", nullptr, nullptr);
  EXPECT_NE(error_of([&] { again->wait(5.0); }).find("died"), std::string::npos);
  p.dev->release_stream(sender);
  EXPECT_TRUE(s->wait(5.0));
  close_both(*p.e0, *p.e1, 2.0);
  EXPECT_TRUE(no_violations(*p.dev));
  EXPECT_EQ(p.dev->open_mappings(), 0);
  EXPECT_EQ(p.dev->live_allocations(), 0u);
}

TEST(IpcSignals, ReceiverDyingBeforeItsFreedWriteFailsTheZeroCopySend) {
  DyingPair p;
  const std::size_t n = 256 << 10;
  char* x = device_copy(*p.dev, pattern(n, 7));
  const Stream receiver = p.e1->stream_for(OpKind::kRecv);
  p.dev->hold_stream(receiver);  // the copy out of x and the freed write are enqueued, never run
  std::vector<char> out(n);
  auto r = p.e1->post(OpKind::kRecv, 0, 1, out.data(), n, "Float", nullptr, nullptr);
  auto s = p.e0->post(OpKind::kSend, 1, 1, x, n, "Float", nullptr, nullptr, x);
  ASSERT_TRUE(r->wait_stream(nullptr, 5.0));
  ASSERT_TRUE(s->wait_stream(nullptr, 5.0));  // enqueued: the done stream waits for `freed`
  EXPECT_GT(p.dev->queued_on(p.e0->done_stream()), 0u);
  p.e0_sees_peer_dead = true;
  const std::string err = error_of([&] { s->wait(5.0); });
  EXPECT_NE(err.find("peer 1"), std::string::npos) << err;
  EXPECT_NE(err.find("died"), std::string::npos) << err;
  EXPECT_TRUE(eventually([&] { return p.dev->queued_on(p.e0->done_stream()) == 0; }));
  p.dev->release_stream(receiver);
  EXPECT_TRUE(r->wait(5.0));
  close_both(*p.e0, *p.e1, 2.0);
  EXPECT_TRUE(no_violations(*p.dev));
  p.dev->free(x);
  EXPECT_EQ(p.dev->live_allocations(), 0u);
}

TEST(IpcSignals, CloseWithMessagesInFlightDrainsThenFreesEverything) {
  Pair p;
  const Stream held = p.e1->stream_for(OpKind::kRecv);
  p.dev->hold_stream(held);
  const std::size_t n = 256 << 10;
  std::vector<char*> bufs;
  std::vector<std::vector<char>> outs(8);
  std::vector<std::shared_ptr<Op>> recvs, sends;
  for (int i = 0; i < 8; ++i) {
    const bool zero_copy = i % 2 == 0;
    bufs.push_back(device_copy(*p.dev, pattern(zero_copy ? n : 3000, 10 + i)));
    outs[i].resize(zero_copy ? n : 3000);
    recvs.push_back(p.e1->post(OpKind::kRecv, 0, i, outs[i].data(), outs[i].size(), "Float", nullptr, nullptr));
    sends.push_back(p.e0->post(OpKind::kSend, 1, i, bufs.back(), outs[i].size(), "Float", nullptr,
                               owned_by_tensor(p.dev, bufs.back()), zero_copy ? bufs.back() : nullptr));
  }
  for (auto& r : recvs) ASSERT_TRUE(r->wait_stream(nullptr, 5.0)) << r->describe();
  std::vector<char> never(100);
  auto orphan = p.e1->post(OpKind::kRecv, 0, 99, never.data(), never.size(), "Float", nullptr, nullptr);
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    p.dev->release_stream(held);
  });
  const auto t0 = Clock::now();
  close_both(*p.e0, *p.e1, 5.0);
  release.join();
  EXPECT_LT(seconds_since(t0), 4.0);
  for (int i = 0; i < 8; ++i) {
    EXPECT_TRUE(recvs[i]->wait(1.0)) << i;
    EXPECT_EQ(outs[i], pattern(outs[i].size(), 10 + i)) << "message " << i;
  }
  EXPECT_NE(error_of([&] { orphan->wait(1.0); }).find("closed"), std::string::npos);
  recvs.clear();
  sends.clear();
  orphan.reset();
  EXPECT_TRUE(no_violations(*p.dev));
  EXPECT_EQ(p.e0->stats().exports_leaked + p.e1->stats().exports_leaked, 0u);
  EXPECT_EQ(p.dev->open_mappings(), 0);
  EXPECT_EQ(p.dev->live_allocations(), 0u) << "rings or sent buffers left allocated";
}

TEST(IpcSignals, SlowReceiverHoldsTheSenderAtTheInFlightLimit) {
  EngineOptions o = small_options();
  o.max_inflight = 4;
  Pair p(o);
  constexpr int kMessages = 20;
  std::vector<std::vector<char>> data, outs(kMessages);
  std::vector<std::shared_ptr<Op>> sends;
  for (int i = 0; i < kMessages; ++i) {
    data.push_back(pattern(1000 + i, 30 + i));
    sends.push_back(p.e0->post(OpKind::kSend, 1, i, data.back().data(), data.back().size(), "Float", nullptr, nullptr));
  }
  EXPECT_TRUE(eventually([&] { return p.e0->host_counters(1, true).first == 4u; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(p.e0->host_counters(1, true).first, 4u) << "published past the in-flight limit";
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(sends[i]->wait(5.0)) << i;
  EXPECT_FALSE(sends[4]->query()) << "enqueued past the in-flight limit";
  for (int i = 0; i < kMessages; ++i) {  // the receiver comes, one message at a time
    outs[i].resize(data[i].size());
    auto r = p.e1->post(OpKind::kRecv, 0, i, outs[i].data(), outs[i].size(), "Float", nullptr, nullptr);
    ASSERT_TRUE(r->wait(5.0)) << r->describe();
    ASSERT_EQ(outs[i], data[i]) << "message " << i;
    const std::uint64_t published = p.e0->host_counters(1, true).first;
    EXPECT_LE(published, static_cast<std::uint64_t>(i + 1 + 4)) << "in-flight limit exceeded";
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  for (auto& s : sends) EXPECT_TRUE(s->wait(5.0));
  EXPECT_TRUE(closed_cleanly(p));
}

TEST(IpcSignals, ASmallRingHoldsTheSenderUntilTheReceiverTakesItsBytes) {
  EngineOptions o = small_options();
  o.num_slots = 2;  // a 128 KiB ring; each message takes 100 KiB of it
  Pair p(o);
  constexpr int kMessages = 8;
  std::vector<std::vector<char>> data, outs(kMessages);
  std::vector<std::shared_ptr<Op>> sends;
  for (int i = 0; i < kMessages; ++i) {
    data.push_back(pattern(100 << 10, 40 + i));
    sends.push_back(p.e0->post(OpKind::kSend, 1, i, data.back().data(), data.back().size(), "Float", nullptr, nullptr));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_LE(p.e0->host_counters(1, true).first, 3u) << "chunks overwrote bytes the receiver had not taken";
  for (int i = 0; i < kMessages; ++i) {
    outs[i].resize(data[i].size());
    auto r = p.e1->post(OpKind::kRecv, 0, i, outs[i].data(), outs[i].size(), "Float", nullptr, nullptr);
    ASSERT_TRUE(r->wait(5.0)) << r->describe();
    ASSERT_EQ(outs[i], data[i]) << "message " << i;
  }
  for (auto& s : sends) EXPECT_TRUE(s->wait(5.0));
  EXPECT_TRUE(closed_cleanly(p));
}

}  // namespace
}  // namespace dualpipe::cuda::testing

namespace dualpipe::cuda::testing {
namespace {

// The host-cost benchmark's own check: it moves real bytes once per size and
// compares them, then times bursts; here only that it runs and reports sane rows.
TEST(IpcSignals, FakeHostCostBenchmarkRunsAndVerifies) {
  EngineOptions o;
  const auto rows = fake_host_cost({256, 1u << 20}, 32, 3, o);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].size_bytes, 256u);
  EXPECT_FALSE(rows[0].zero_copy);
  EXPECT_TRUE(rows[1].zero_copy) << "1 MiB sends go zero-copy by default";
  for (const auto& r : rows) {
    EXPECT_TRUE(r.verified);
    EXPECT_GT(r.host_us_per_msg, 0.0);
    EXPECT_GE(r.host_us_per_msg, r.post_us_per_msg);
  }
}

}  // namespace
}  // namespace dualpipe::cuda::testing
