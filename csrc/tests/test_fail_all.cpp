// fail_all() on both engines: a wait blocked on a transfer whose peer will never
// come ends at once with the given message, and so does every later post; what
// had completed before stays complete. Runs under TSan and ASan in ctest.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda/ipc_engine.h"
#include "fake_device.h"
#include "ipc_pair.h"
#include "shm_engine.h"
#include "test_util.h"

namespace dualpipe {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

constexpr const char* kWhy = "pipeline rank 2 failed: RuntimeError: boom";

//! Rank 0 and rank 1 engines in this process, connected both ways.
struct ShmPair {
  shm::Engine e0, e1;
  explicit ShmPair(const shm::ChannelConfig& cfg) : e0(0, cfg), e1(1, cfg) {
    e1.attach_recv_channel(0, e0.create_send_channel(1));
    e0.attach_recv_channel(1, e1.create_send_channel(0));
  }
};

void expect_failed_with_why(const Request& r) {
  ASSERT_EQ(r.state(), Request::State::kFailed);
  EXPECT_NE(r.error().find(kWhy), std::string::npos) << r.error();
}

TEST(ShmFailAll, BlockedWaitsOfSmallLargeAndSendsEndAtOnceAndLaterPostsFail) {
  auto cfg = shm::testing::small_config(2, 4096);
  ShmPair p(cfg);
  std::vector<unsigned char> small(64), large(1 << 20), out(3 * 4096);
  // A receive nobody sends (small: its waiter sleeps on the ring; large: the worker watches), and a
  // send that fills the ring and waits for a receiver that never drains it.
  auto r_small = p.e0.recv(1, small.data(), small.size(), 1, 0);
  auto r_large = p.e0.recv(1, large.data(), large.size(), 2, 0);
  auto s = p.e0.send(1, out.data(), out.size(), 3, 0);
  std::vector<std::thread> waiters;
  std::vector<double> took(3, -1.0);
  std::vector<std::shared_ptr<Request>> reqs{r_small, r_large, s};
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    waiters.emplace_back([&, i] {
      const auto t0 = Clock::now();
      EXPECT_TRUE(reqs[i]->wait(30.0));
      took[i] = seconds_since(t0);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // every waiter asleep by now
  for (auto& r : reqs) EXPECT_FALSE(r->query());
  p.e0.fail_all(kWhy);
  for (auto& t : waiters) t.join();
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    expect_failed_with_why(*reqs[i]);
    EXPECT_LT(took[i], 0.3 + 1.0) << "request " << i;
  }
  auto later = p.e0.recv(1, small.data(), small.size(), 4, 0);
  ASSERT_TRUE(later->wait(1.0));
  expect_failed_with_why(*later);
  auto later_send = p.e0.send(1, small.data(), small.size(), 4, 0);
  ASSERT_TRUE(later_send->wait(1.0));
  expect_failed_with_why(*later_send);
  p.e0.fail_all("a second failure");  // the first text sticks
  auto third = p.e0.recv(1, small.data(), small.size(), 5, 0);
  ASSERT_TRUE(third->wait(1.0));
  expect_failed_with_why(*third);
  p.e0.close();
  p.e1.close();
}

TEST(ShmFailAll, CompletedTransfersStayCompleteAndThePeerIsUntouched) {
  ShmPair p(shm::testing::small_config(4, 4096));
  std::vector<unsigned char> src(100, 7), dst(100, 0);
  auto r = p.e1.recv(0, dst.data(), dst.size(), 1, 0);
  auto s = p.e0.send(1, src.data(), src.size(), 1, 0);
  ASSERT_TRUE(s->wait(10.0));
  ASSERT_TRUE(r->wait(10.0));
  p.e0.fail_all(kWhy);
  EXPECT_EQ(s->state(), Request::State::kDone);
  EXPECT_EQ(dst, src);
  // The other engine's channels (its own receives) still work among themselves: it was not told.
  EXPECT_TRUE(p.e1.has_recv_channel(0));
  p.e0.close();
  p.e1.close();
}

TEST(IpcFailAll, PendingOpsAndLaterPostsFailWithTheMessage) {
  cuda::testing::Pair p;
  std::vector<char> buf(4096);
  auto r = p.e0->post(cuda::OpKind::kRecv, 1, 7, buf.data(), buf.size(), "Float", nullptr, nullptr);
  double took = -1.0;
  std::string error;
  std::thread waiter([&] {
    const auto t0 = Clock::now();
    try {
      r->wait(30.0);
    } catch (const std::runtime_error& e) {
      error = e.what();
    }
    took = seconds_since(t0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  p.e0->fail_all(kWhy);
  waiter.join();
  EXPECT_NE(error.find(kWhy), std::string::npos) << error;
  EXPECT_LT(took, 0.2 + 1.0);
  EXPECT_TRUE(r->failed());
  try {
    p.e0->post(cuda::OpKind::kSend, 1, 8, buf.data(), buf.size(), "Float", nullptr, nullptr);
    ADD_FAILURE() << "a post after fail_all succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(kWhy), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dualpipe
